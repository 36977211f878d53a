"""Datasets by content: JSON lines, plain text (or Parquet) made into one canonical records file, its hash and splits.

The records file is UTF-8 JSON lines, one object per line with sorted keys: {"text"} for language
modelling, {"prompt", "chosen", "rejected"} for preference pairs. Its sha256 is the dataset's
identity; SHARDCAST carries it in verified shards. Each node tokenizes the records with the task's
tokenizer (node/train/hf.py), so the same file gives every node the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from protocol.errors import ConfigError

TEXT_KEYS = ("text",)
PAIR_KEYS = ("chosen", "prompt", "rejected")
MAX_RECORD_BYTES = 1 << 20


def _record(obj, where: str, text_field: str) -> dict:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: a record must be a JSON object")
    if all(isinstance(obj.get(k), str) for k in PAIR_KEYS):
        return {k: obj[k] for k in PAIR_KEYS}
    value = obj.get(text_field)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: no non-empty string field {text_field!r} (and not a prompt/chosen/rejected "
                          "pair); name the field with --text-field")
    return {"text": value}


def _read_jsonl(path: Path, text_field: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{n}: not JSON: {exc}") from None
            out.append(_record(obj, f"{path}:{n}", text_field))
    return out


def _read_text(path: Path) -> list[dict]:
    """Plain text: one record per paragraph (blank-line separated)."""
    text = path.read_text(encoding="utf-8")
    return [{"text": p.strip()} for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def _read_parquet(path: Path, text_field: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path)
    return [_record(row, f"{path} row {i}", text_field) for i, row in enumerate(table.to_pylist())]


def read_sources(paths: list[str | os.PathLike], *, text_field: str = "text") -> list[dict]:
    """Records of the given files in the order given: .jsonl/.json lines, .parquet, anything else plain text."""
    records: list[dict] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise ConfigError(f"{p} is not a file")
        try:
            if p.suffix in (".jsonl", ".json", ".ndjson"):
                records += _read_jsonl(p, text_field)
            elif p.suffix == ".parquet":
                records += _read_parquet(p, text_field)
            else:
                records += _read_text(p)
        except UnicodeDecodeError:
            raise ConfigError(f"{p} is not UTF-8 text") from None
    if not records:
        raise ConfigError("no records found in the given files")
    kinds = {"pairs" if "chosen" in r else "text" for r in records}
    if len(kinds) > 1:
        raise ConfigError("the files mix text records and prompt/chosen/rejected pairs; publish them separately")
    return records


def encode_records(records: list[dict]) -> bytes:
    out = bytearray()
    for r in records:
        line = json.dumps(r, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
        if len(line) > MAX_RECORD_BYTES:
            raise ConfigError(f"a record of {len(line)} bytes is over the {MAX_RECORD_BYTES} byte limit")
        out += line + b"\n"
    return bytes(out)


def decode_records(data: bytes) -> list[dict]:
    """Records of a canonical file; ValueError if it is not one (a peer's file is checked by hash first)."""
    records = []
    for n, line in enumerate(data.split(b"\n")[:-1], 1):
        obj = json.loads(line)
        if not isinstance(obj, dict) or not (set(obj) == set(TEXT_KEYS) or set(obj) == set(PAIR_KEYS)) \
                or not all(isinstance(v, str) for v in obj.values()):
            raise ValueError(f"records file line {n} is not a text record or a preference pair")
        records.append(obj)
    if not data.endswith(b"\n") or not records:
        raise ValueError("records file is empty or does not end with a newline")
    return records


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_pairs(records: list[dict]) -> bool:
    return "chosen" in records[0]


def split_records(num_records: int, num_shards: int,
                  heldout_fraction: float) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Record ranges [start, end) of num_shards training shards, then the held-out tail (the spec's split)."""
    held = max(1, math.ceil(num_records * heldout_fraction))
    train = num_records - held
    if train < num_shards:
        raise ConfigError(f"{num_records} records leave {train} to train on after the held-out "
                          f"{held}, fewer than dataset.num_shards = {num_shards}")
    bounds = [train * i // num_shards for i in range(num_shards + 1)]
    return list(zip(bounds[:-1], bounds[1:])), (train, num_records)
