"""Durable file writes (temp file, fsync, rename, fsync of the directory: a crash leaves old or new, never torn),
and the round-numbered files a task keeps."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """A rename is only durable once the directory entry is on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | bytearray | memoryview, *, tmp_dir: Path | None = None) -> None:
    """Replace ``path`` with ``data``; ``tmp_dir`` must be on the same filesystem (default: beside it)."""
    path = Path(path)
    tmp = (tmp_dir or path.parent) / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def round_files(directory: Path, prefix: str, suffix: str) -> list[tuple[int, Path]]:
    """(r, path) of every ``prefix<r><suffix>`` in ``directory``, in no order; other names are skipped."""
    found = []
    for path in directory.glob(f"{prefix}*{suffix}"):
        try:
            found.append((int(path.name[len(prefix):-len(suffix)]), path))
        except ValueError:
            continue
    return found
