"""A task's ledger: the receipts this node sealed, appended to ``<task dir>/ledger.bin`` as rounds close.

One receipt per producer the round's agreed weights were made of (protocol/receipts.py), sealed with
the node's key, fsynced with the round. A crash mid-write leaves a torn last frame, which the next
start cuts off; a damaged file is kept aside as ``ledger.bin.damaged`` and its readable part goes on.
A write that fails (a full disk) is undone, logged and counted, and never stops the task.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from protocol.envelope import seal
from protocol.keys import Keypair
from protocol.receipts import Credit, LedgerRead, Receipt, frame, parse_ledger, receipts_for

log = logging.getLogger("shoal.tasks")

FILE = "ledger.bin"


def read(directory: Path, task_id: str | None = None) -> LedgerRead:
    """Every receipt in the task directory's ledger (signatures checked); empty when there is none."""
    try:
        data = (directory / FILE).read_bytes()
    except FileNotFoundError:
        data = b""
    return parse_ledger(data, task_id=task_id)


class Ledger:
    """Appends sealed receipts; blocking (file IO and fsync): call it from a worker thread."""

    def __init__(self, directory: Path, keypair: Keypair, task_id: str, num_slices: int):
        self.path = directory / FILE
        self.keypair, self.task_id, self.num_slices = keypair, task_id, num_slices
        self.count = 0
        """Receipts in the file (read at start, then appended)."""
        self.errors = 0
        self._size: int | None = None

    def open(self) -> None:
        """Read what is there, cutting off a torn tail or keeping a damaged file aside (OSError: left for later)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        found = parse_ledger(data, task_id=self.task_id)
        if found.end < len(data):
            if not found.torn:
                kept = self.path.with_name(FILE + ".damaged")
                shutil.copyfile(self.path, kept)
                log.warning("task %s: the ledger is damaged after %d receipt(s); the whole file is kept in %s",
                            self.task_id[:12], len(found.receipts), kept)
            with open(self.path, "r+b") as f:
                f.truncate(found.end)
                os.fsync(f.fileno())
        self.count, self._size = len(found.receipts), found.end

    def record(self, round_index: int, weights_hash: str, credits: tuple[Credit, ...]) -> list[Receipt]:
        """Seal and append one receipt per credit; on failure the file is left as it was and [] returned."""
        receipts = receipts_for(self.task_id, round_index, weights_hash, self.num_slices, credits)
        if not receipts:
            return []
        try:
            if self._size is None:
                self.open()
            data = b"".join(frame(seal(r, self.keypair)) for r in receipts)
            with open(self.path, "ab") as f:
                try:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                except OSError:
                    f.truncate(self._size)
                    raise
        except OSError as exc:
            self.errors += 1
            log.warning("task %s round %d: receipts not written (%s); the task goes on without them",
                        self.task_id[:12], round_index, exc.strerror or exc)
            return []
        self._size += len(data)
        self.count += len(receipts)
        return receipts
