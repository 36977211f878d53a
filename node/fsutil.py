"""Durable file writes (temp file, fsync, rename, fsync of the directory: a crash leaves old or new, never torn),
and the round-numbered files a task keeps."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

_TEMP = re.compile(r"^\..+\.(?:tmp(\d+)|(\d+)\.\d+\.(?:tmp|link))$")
"""The temporary names of write_atomic (``.NAME.PID.THREAD.tmp``), of diloco.save_named (``.NAME.tmpPID``) and of
the checkpoint's hard links (``.NAME.PID.THREAD.link``)."""


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


def remove_stale_temps(directory: Path) -> list[Path]:
    """Remove the temporary files that processes no longer alive left in ``directory`` and its subdirectories
    (a write cut short by a kill: a whole model's size each, and never renamed); those of live processes, this one
    included, stay. Returns what was removed."""
    removed = []
    for path in Path(directory).rglob(".*"):
        match = _TEMP.match(path.name)
        if match is None or not path.is_file():
            continue
        pid = int(match.group(1) or match.group(2))
        if pid == os.getpid() or _alive(pid):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
