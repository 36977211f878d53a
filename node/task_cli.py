"""`shoal task`: publish a task spec through the running node, list its tasks, show one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from node.cli import DataDir, Url, _client, fail, run_cli

task_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="Publish, list and inspect training tasks on the running node.")


@task_app.command()
def publish(spec: Path = typer.Argument(..., help="Task spec TOML file (see examples/tiny-task.toml)."),
            data_dir: Optional[Path] = DataDir, url: Optional[str] = Url) -> None:
    """Sign SPEC with this node's key as initiator and gossip it; prints the task id."""
    from protocol.spec_toml import advice, load_spec_toml
    try:
        text = spec.read_text()
    except OSError as exc:
        fail(f"cannot read {spec}: {exc.strerror}")
    parsed = run_cli(lambda: load_spec_toml(text))  # a mistake is reported here, before the node is asked
    for note in advice(parsed):
        typer.echo(f"note: {note}", err=True)
    answer = run_cli(lambda: _client(data_dir, url).call("/task/publish", body={"toml": text}))
    typer.echo(answer["task_id"])
    if answer.get("decision") == "declined":
        typer.echo(f"note: this node declined to train it: {answer.get('reason')}", err=True)


@task_app.command("list")
def list_tasks(data_dir: Optional[Path] = DataDir, url: Optional[str] = Url,
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Tasks this node knows: joined or declined, round, members and eval loss."""
    data = run_cli(lambda: _client(data_dir, url).call("/tasks"))
    if as_json:
        typer.echo(json.dumps(data, indent=1))
        return
    from node.views import print_task_list
    print_task_list(data)


@task_app.command()
def show(task_id: str = typer.Argument(..., help="Task id or a unique prefix (at least 4 characters)."),
         data_dir: Optional[Path] = DataDir, url: Optional[str] = Url,
         as_json: bool = typer.Option(False, "--json", help="Print the raw JSON instead of tables.")) -> None:
    """Everything about one task: spec, phase, round, members, losses, weights agreement, traffic."""
    data = run_cli(lambda: _client(data_dir, url).call(f"/task?id={task_id}"))
    if as_json:
        typer.echo(json.dumps(data, indent=1))
        return
    from node.views import print_task
    print_task(data)


@task_app.command()
def export(task_id: str = typer.Argument(..., help="Task id or a unique prefix (at least 4 characters)."),
           out: Path = typer.Option(..., "--out", help="New directory to write the model into."),
           adapter: bool = typer.Option(False, "--adapter", help="Write the LoRA adapter (peft) instead of merging it."),
           data_dir: Optional[Path] = DataDir) -> None:
    """Write an hf task's current weights as a directory transformers (and peft) load, with a model card."""
    from node.cli import _data_dir_default
    from node.export import export_task
    info = run_cli(lambda: export_task(data_dir or _data_dir_default(), task_id, out, adapter=adapter))
    typer.echo(f"wrote {info['out']}: {info['mode']}, round {info['rounds']}, eval loss {info['eval_loss']}, "
               f"weights {info['weights_hash'][:16]}")


@task_app.command()
def cancel(task_id: str = typer.Argument(..., help="Task id or a unique prefix (at least 4 characters)."),
           reason: str = typer.Option("", "--reason", help="Shown on every node."),
           data_dir: Optional[Path] = DataDir, url: Optional[str] = Url) -> None:
    """End a task on every node: signed with this node's key, honoured only if it is the task's initiator."""
    answer = run_cli(lambda: _client(data_dir, url).call("/task/cancel", body={"id": task_id, "reason": reason}))
    typer.echo(f"cancelled {answer['task_id']}")


WATCH_POLL_S = 1.0
ENDED = ("finished", "declined", "failed", "cancelled")


@task_app.command()
def watch(task_id: str = typer.Argument(..., help="Task id or a unique prefix (at least 4 characters)."),
          data_dir: Optional[Path] = DataDir, url: Optional[str] = Url,
          as_json: bool = typer.Option(False, "--json", help="One JSON object per change.")) -> None:
    """Follow a task live: a line per round and phase change, until it finishes, fails or is cancelled."""
    import time

    client = run_cli(lambda: _client(data_dir, url))
    last = None
    while True:
        t = run_cli(lambda: client.call(f"/task?id={task_id}"))
        phase = t.get("phase") or t.get("decision")
        rows = t.get("agreement") or []
        key = (phase, len(rows))
        if key != last:
            last = key
            if as_json:
                typer.echo(json.dumps({k: t.get(k) for k in ("id", "phase", "round", "rounds", "eval_loss",
                                                             "members", "detail")}))
            else:
                row = rows[-1] if rows else {}
                loss = t.get("eval_loss")
                typer.echo(f"{time.strftime('%H:%M:%S')}  round {t.get('round')}/{t.get('rounds', '-')}  {phase}  "
                           f"eval_loss {'-' if loss is None else f'{loss:.4f}'}  members {len(t.get('members') or [])}"
                           f"  agree {row.get('peers_agreeing', '-')}  {t.get('detail') or t.get('reason') or ''}")
        if phase in ENDED:
            return
        time.sleep(WATCH_POLL_S)
