"""A bounded slice of the wire fuzzer in CI: mutated frames on every protocol into a real node process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_two_thousand_mutated_frames_leave_the_node_serving(tmp_path):
    out = tmp_path / "fuzz.json"
    done = subprocess.run([sys.executable, "scripts/fuzz_wire.py", "--frames", "2000", "--concurrency", "4",
                           "--seed", "7", "--time-limit-s", "400", "--json-out", str(out),
                           "--work-dir", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=560)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["frames_sent"] == 2000, report
    assert report["daemon_exits"] == 0 and report["victim_exit_code"] == 0, report
    assert report["honest_sees_victim_alive"] and report["victim_sees_honest_alive"], report
    assert sum(v for k, v in report["by_kind"].items() if k != "gossip") > 300, report["by_kind"]
    assert report["victim_drops"], "the node counted nothing: the frames never reached its checks"
    assert done.returncode == 0, done.stderr[-3000:]
