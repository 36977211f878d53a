"""What a killed writer leaves: its temporary files are removed when the task directory is opened again, and
nobody else's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from node.fsutil import remove_stale_temps

# A writer blocked in its fsync, as a process killed mid-write is: the real writers name their temporary files.
WRITER = """
import os, sys, threading, time
from pathlib import Path
os.fsync = lambda fd: time.sleep(120)
import torch
from node.fsutil import write_atomic
from node.train.diloco import save_named
d = Path(sys.argv[1])
threading.Thread(target=write_atomic, args=(d / "meta.json", b"{}"), daemon=True).start()
save_named(d / "checkpoints" / "weights.safetensors", {"w": torch.zeros(1000)})
"""


def test_a_killed_writers_temporary_files_go_and_live_ones_stay(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "weights.safetensors").write_bytes(b"kept")
    (tmp_path / ".hidden").write_bytes(b"not ours")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.rglob(f"*{writer.pid}*"))) < 2:
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never got to its fsyncs"
            time.sleep(0.05)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    left = sorted(p.name for p in tmp_path.rglob(f"*{writer.pid}*"))
    # One still being written by a live process, this one or another, stays.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = tmp_path / f".update.safetensors.tmp{os.getpid()}"
        theirs = tmp_path / "checkpoints" / f".meta.json.{live.pid}.140.tmp"
        for path in (mine, theirs):
            path.write_bytes(b"in flight")
        removed = remove_stale_temps(tmp_path)
        assert sorted(p.name for p in removed) == left and len(left) == 2, (left, removed)
        assert not list(tmp_path.rglob(f"*{writer.pid}*"))
        assert mine.exists() and theirs.exists()
        assert (tmp_path / "weights.safetensors").read_bytes() == b"kept" and (tmp_path / ".hidden").exists()
    finally:
        live.kill()
        live.wait()
