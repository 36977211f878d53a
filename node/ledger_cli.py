"""`shoal ledger [TASK]`: the receipts this node sealed, read from its data dir (the node need not run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from node.cli import DataDir, run_cli
from protocol.errors import ConfigError
from protocol.receipts import Receipt, digest, latest


def ledger(task: Optional[str] = typer.Argument(None, help="Task id or a unique prefix (at least 4 characters); "
                                                "without it, one line per task."),
           data_dir: Optional[Path] = DataDir,
           first: Optional[int] = typer.Option(None, "--from", min=0, help="Only rounds from this one on."),
           last: Optional[int] = typer.Option(None, "--to", min=0, help="Only rounds up to this one."),
           rounds: bool = typer.Option(False, "--rounds", help="One line per receipt instead of per producer."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Receipts for the producers whose updates made each agreed round's weights: per producer, the rounds,
    slices and samples credited, and a digest that two honest nodes' ledgers over the same rounds share."""
    from node.cli import _data_dir_default
    directory = data_dir or _data_dir_default()
    if task is None:
        rows = [_summary(d, first, last) for d in _task_dirs(directory)]
        if as_json:
            typer.echo(json.dumps({"tasks": rows}, indent=1))
        elif not rows:
            typer.echo(f"no tasks in {directory / 'tasks'}")
        for r in [] if as_json else rows:
            typer.echo(f"{r['task_id'][:12]}  {r['name']}  rounds {_span(r)}  {r['receipts']} receipt(s), "
                       f"{len(r['producers'])} producer(s)  digest {r['digest'][:16]}")
        return
    from node.export import find_task
    found = _summary(run_cli(lambda: find_task(directory, task)), first, last, with_receipts=True)
    if as_json:
        typer.echo(json.dumps(found, indent=1))
        return
    typer.echo(f"task {found['task_id']} ({found['name']})\nrounds {_span(found)}, {found['receipts']} receipt(s) "
               f"sealed by {', '.join(found['signers']) or '-'}\ndigest {found['digest']}")
    if found["invalid"] or found["torn"]:
        typer.echo(f"warning: {found['invalid']} frame(s) are not valid receipts of this task"
                   + (" and the file ends mid-receipt" if found["torn"] else "") + "; they are not shown", err=True)
    if rounds:
        typer.echo(f"{'round':>6}  {'producer':<54} {'samples':>9}  slices  weights")
        for r in found["rows"]:
            typer.echo(f"{r['round']:>6}  {r['producer']:<54} {r['samples']:>9}  {r['slices']}/{r['num_slices']}"
                       f"     {r['weights_hash'][:16]}")
        return
    typer.echo(f"{'producer':<54} {'rounds':>6} {'samples':>11}  share  last round")
    for p in found["producers"]:
        typer.echo(f"{p['producer']:<54} {p['rounds']:>6} {p['samples']:>11}  {p['share']:.3f}  {p['last_round']}")


def _task_dirs(data_dir: Path) -> list[Path]:
    root = data_dir / "tasks"
    return sorted(p.parent for p in root.glob("*/spec.sealed")) if root.is_dir() else []


def _span(r: dict) -> str:
    return "-" if r["first_round"] is None else f"{r['first_round']}..{r['last_round']}"


def _summary(directory: Path, first: int | None, last: int | None, *, with_receipts: bool = False) -> dict:
    from node.export import load_task
    from node.tasks.ledger import read
    try:
        spec, _ = load_task(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{directory}: the task's spec cannot be read ({exc})") from None
    tid = directory.name
    try:
        found = read(directory, tid)
    except OSError as exc:
        raise ConfigError(f"{directory}: the ledger cannot be read ({exc.strerror or exc})") from None
    kept = [r for r in latest(s.message for s in found.receipts)
            if (first is None or r.round >= first) and (last is None or r.round <= last)]
    producers: dict[str, dict] = {}
    for r in kept:
        p = producers.setdefault(r.producer, {"producer": r.producer, "rounds": 0, "samples": 0, "slices": 0,
                                              "of_slices": 0, "last_round": r.round})
        p["rounds"] += 1
        p["samples"] += r.samples
        p["slices"] += r.slices
        p["of_slices"] += r.num_slices
        p["last_round"] = max(p["last_round"], r.round)
    out = {"task_id": tid, "name": spec.name, "receipts": len(kept),
           "first_round": min((r.round for r in kept), default=None),
           "last_round": max((r.round for r in kept), default=None),
           "signers": sorted({s.signer for s in found.receipts}), "digest": digest(kept),
           "invalid": found.invalid, "torn": found.torn,
           "producers": [{**{k: v for k, v in p.items() if k != "of_slices"}, "share": round(p["slices"] / p["of_slices"], 4)}
                         for p in sorted(producers.values(), key=lambda p: (-p["rounds"], p["producer"]))]}
    if with_receipts:
        out["rows"] = [_row(r) for r in kept]
    return out


def _row(r: Receipt) -> dict:
    return {"round": r.round, "producer": r.producer, "samples": r.samples, "slices": r.slices,
            "num_slices": r.num_slices, "weights_hash": r.weights_hash}
