"""scripts/bench_wire.py at a small size: bulk bytes cost little beyond their payload, a small stream a few hundred."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_bench_wire_reports_the_bulk_and_small_stream_overheads(tmp_path):
    out = tmp_path / "wire.json"
    done = subprocess.run([sys.executable, "scripts/bench_wire.py", "--bulk-mib", "2", "--streams", "20",
                           "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["bulk"]["payload_bytes"] == 2 << 20
    assert 0 < report["bulk"]["overhead_ratio"] < 0.01  # Noise tags and Yamux headers on 64 KiB frames
    # Negotiation, Yamux and Noise per stream: more than nothing, less than a kilobyte each way.
    assert 100 < report["small_streams"]["overhead_bytes_sent_per_stream"] < 1024, report
