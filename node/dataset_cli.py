"""`shoal dataset publish FILES...` and `shoal model publish DIR`: bring one's own data and model to the swarm."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import List, Optional

import typer

from node.cli import DataDir, Url, _client, run_cli

dataset_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Publish datasets (JSON lines, plain text, Parquet) by content hash.")
model_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Publish a transformers model directory (config, tokenizer, safetensors).")


def _publish_file(path: Path, data_dir: Optional[Path], url: Optional[str]) -> dict:
    """Upload the file's bytes to the node (it never reads paths outside its publish dir)."""
    from node.uploads import upload_and_publish
    return run_cli(lambda: upload_and_publish(_client(data_dir, url), path))


@dataset_app.command("publish")
def publish_dataset(files: List[Path] = typer.Argument(..., help=".jsonl files ({\"text\"} or {\"prompt\", "
                                                                 "\"chosen\", \"rejected\"} per line), .parquet, "
                                                                 "or plain text (a record per paragraph)."),
                    text_field: str = typer.Option("text", "--text-field", help="The JSON field holding the text."),
                    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
                    data_dir: Optional[Path] = DataDir, url: Optional[str] = Url) -> None:
    """Make one canonical records file of FILES, publish it over SHARDCAST, print the spec's dataset table."""
    from node import dataset
    records = run_cli(lambda: dataset.read_sources(files, text_field=text_field))
    data = run_cli(lambda: dataset.encode_records(records))
    with tempfile.TemporaryDirectory(prefix="shoal-dataset-") as tmp:
        path = Path(tmp) / f"{dataset.content_hash(data)}.jsonl"
        path.write_bytes(data)
        answer = _publish_file(path, data_dir, url)
    out = {"kind": "published", "manifest": answer["manifest_id"], "sha256": dataset.content_hash(data),
           "max_bytes": max(1024, len(data)), "records": len(records),
           "pairs": dataset.is_pairs(records)}
    if as_json:
        typer.echo(json.dumps(out, indent=1))
        return
    typer.echo(f"# {len(records)} {'preference pairs' if out['pairs'] else 'text records'}, {len(data):,} bytes; "
               "for the task spec:")
    typer.echo("[task.dataset]")
    for key in ("kind", "manifest", "sha256", "max_bytes"):
        value = out[key]
        typer.echo(f"{key} = {json.dumps(value)}")
    typer.echo("num_shards = 4")


@model_app.command("publish")
def publish_model(directory: Path = typer.Argument(..., help="A directory as save_pretrained writes it."),
                  as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
                  data_dir: Optional[Path] = DataDir, url: Optional[str] = Url) -> None:
    """Check DIR (safetensors only, no remote code), publish it as one bundle, print hf.model_manifest."""
    from node import bundle
    with tempfile.TemporaryDirectory(prefix="shoal-model-") as tmp:
        path = Path(tmp) / "model.bundle"
        info = run_cli(lambda: bundle.pack(directory, path))
        answer = _publish_file(path, data_dir, url)
    out = {"model_manifest": answer["manifest_id"], "architecture": info.architecture, "num_params": info.num_params,
           "vocab_size": info.vocab_size, "bytes": answer["bytes"]}
    if as_json:
        typer.echo(json.dumps(out, indent=1))
        return
    typer.echo(f"# {info.architecture}, {info.num_params:,} parameters, vocab {info.vocab_size}; for the task spec:")
    typer.echo("[task.hf]")
    typer.echo(f"model_manifest = \"{answer['manifest_id']}\"")
