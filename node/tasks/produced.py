"""The update this node signed for a round, kept on disk so that a restarted process announces it again.

A producer killed after its update went out and restarted into the same round would otherwise train the round
again and sign a second update with other bytes (on a GPU the inner steps are not bit-identical). Peers that heard
different ones aggregate different inputs, and the swarm splits for a round. The record is written, durably, before
the machine publishes the update; the runner answers a Train for that round and base from it, with the slices the
shard store still holds or encodes again from the trainer's Δ.
"""

from __future__ import annotations

import json
from pathlib import Path

from node.fsutil import round_files, write_atomic

PREFIX = "produced-r"
KEEP_ROUNDS = 2
"""Records of rounds this far behind the newest one written are deleted."""


def _path(directory: Path, round_: int) -> Path:
    return directory / f"{PREFIX}{round_}.json"


def save(directory: Path, round_: int, *, base_hash: str, samples: int, manifest_ids, losses, shards) -> None:
    record = {"round": round_, "base_hash": base_hash, "samples": samples, "manifest_ids": list(manifest_ids),
              "losses": list(losses), "shards": list(shards)}
    write_atomic(_path(directory, round_), json.dumps(record, separators=(",", ":")).encode())
    for r, old in round_files(directory, PREFIX, ".json"):
        if r <= round_ - KEEP_ROUNDS:
            old.unlink(missing_ok=True)


def load(directory: Path, round_: int, base_hash: str) -> dict | None:
    """The record of ``round_`` trained from ``base_hash``, or None (none, another base, or a damaged file)."""
    try:
        record = json.loads(_path(directory, round_).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("round") != round_ or record.get("base_hash") != base_hash:
        return None
    ids, losses, shards = record.get("manifest_ids"), record.get("losses"), record.get("shards")
    if not (isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids)
            and isinstance(losses, list) and all(isinstance(x, (int, float)) for x in losses)
            and isinstance(shards, list) and all(isinstance(i, int) for i in shards)
            and isinstance(record.get("samples"), int)):
        return None
    return record
