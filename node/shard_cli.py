"""`shoal shard publish|fetch`: hand a file to the running node's SHARDCAST, or fetch one by manifest id."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from node import control

shard_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Publish and fetch verified shards.")

POLL_S = 0.25


def _client(data_dir: Optional[Path], url: Optional[str]) -> control.ControlClient:
    from node.cli import _client
    return _client(data_dir, url)


@shard_app.command("publish")
def publish(path: Path = typer.Argument(..., help="A safetensors file, or any file."),
            data_dir: Optional[Path] = typer.Option(None, "--data-dir"),
            url: Optional[str] = typer.Option(None, "--url")) -> None:
    """Upload PATH to the running node, which stores it as verified shards; prints its manifest id."""
    from node.cli import run_cli
    from node.uploads import upload_and_publish
    if not path.is_file():
        typer.echo(f"shoal: error: {path} is not a file", err=True)
        raise typer.Exit(2)
    client = run_cli(lambda: _client(data_dir, url))
    answer = run_cli(lambda: upload_and_publish(client, path))
    typer.echo(answer["manifest_id"])
    typer.echo(f"{answer['bytes']:,} bytes in {answer['shards']} shard(s)", err=True)


@shard_app.command("fetch")
def fetch(manifest_id: str = typer.Argument(..., help="The id printed by `shoal shard publish`."),
          out: Path = typer.Option(..., "--out", help="Where to write the verified file."),
          timeout_s: float = typer.Option(3600.0, "--timeout", help="Give up after this many seconds."),
          data_dir: Optional[Path] = typer.Option(None, "--data-dir"),
          url: Optional[str] = typer.Option(None, "--url")) -> None:
    """Fetch a manifest's shards from every peer that holds them, verify them, and write the file."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    from node.cli import run_cli
    client = run_cli(lambda: _client(data_dir, url))
    body = {"manifest_id": manifest_id, "out": str(out.resolve())}
    job = run_cli(lambda: client.call("/shard/fetch", body=body))
    deadline = time.monotonic() + timeout_s
    columns = (TextColumn("[bold]fetch"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[rate]}"),
               TextColumn("{task.fields[sources]} source(s)"), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("fetch", total=None, rate="", sources=0)
        while job["state"] == "running":
            if time.monotonic() > deadline:
                typer.echo(f"shoal: error: fetch not finished after {timeout_s:.0f} s; it goes on in the node", err=True)
                raise typer.Exit(1)
            time.sleep(POLL_S)
            job = run_cli(lambda: client.call(f"/shard/fetch?id={job['manifest_id']}"))
            bar.update(task, total=job["bytes_total"] or None, completed=job["bytes_done"],
                       rate=f"{job['bytes_per_s'] / 1e6:.1f} MB/s", sources=job["num_sources"])
    if job["state"] != "done":
        typer.echo(f"shoal: error: fetch failed: {job['error']}", err=True)
        raise typer.Exit(1)
    typer.echo(f"wrote {out} ({job['bytes_total']:,} bytes verified, {job['seconds']:.1f} s)")
