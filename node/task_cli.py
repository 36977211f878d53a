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
    from protocol.task import load_spec_toml
    try:
        text = spec.read_text()
    except OSError as exc:
        fail(f"cannot read {spec}: {exc.strerror}")
    run_cli(lambda: load_spec_toml(text))  # a mistake is reported here, before the node is asked
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
