"""A task's per-round history (eval loss, members, weights hash) in its directory, so it survives restarts."""

from __future__ import annotations

import json
from pathlib import Path

from node.fsutil import write_atomic

FILE = "history.json"
MAX_ROUNDS = 100_000


def load(directory: Path) -> list[dict]:
    """The rounds recorded so far, oldest first; [] if there are none or the file is damaged."""
    try:
        rows = json.loads((directory / FILE).read_text())
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("round"), int)] if isinstance(rows, list) else []


def record(directory: Path, rows: list[dict]) -> None:
    """Rewrite the history (one row per round, the newest row wins) atomically."""
    by_round = {r["round"]: r for r in rows}
    ordered = [by_round[k] for k in sorted(by_round)][-MAX_ROUNDS:]
    write_atomic(directory / FILE, json.dumps(ordered, separators=(",", ":")).encode())
