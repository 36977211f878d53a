"""scripts/bench_wire.py at a small size: bulk bytes cost little beyond their payload, a small stream a few
hundred, a gossip message about its own signed envelope."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_bench_wire_reports_the_bulk_and_small_stream_overheads(tmp_path):
    out = tmp_path / "wire.json"
    done = subprocess.run([sys.executable, "scripts/bench_wire.py", "--bulk-mib", "2", "--streams", "20", "--messages", "20",
                           "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["bulk"]["payload_bytes"] == 2 << 20
    assert 0 < report["bulk"]["overhead_ratio"] < 0.01  # Noise tags and Yamux headers on 64 KiB frames
    # Negotiation, Yamux and Noise per stream: more than nothing, less than a kilobyte each way.
    assert 100 < report["small_streams"]["overhead_bytes_sent_per_stream"] < 1024, report
    # A 1,000-byte message: its envelope (publisher, sequence number, topic, key, signature, ~165 bytes),
    # Noise and Yamux framing (~30) and a share of the heartbeats' control. py-libp2p's peer record
    # in every RPC made it about 1,800 on the publisher's side and 480 on the receiver's.
    gossip = report["gossip"]
    assert 1000 < gossip["publisher_wire_bytes_per_message"] < 1400, report
    assert gossip["receiver_wire_bytes_per_message"] < 100, report  # a window update; 143 with IDONTWANT for each
