"""scripts/bench_shardcast.py end to end with tiny sizes: real daemon processes on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_bench_reports_both_modes_and_raw_rates(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "scripts/bench_shardcast.py", "--receivers", "2", "--size-mb", "4",
                           "--raw-mb", "4", "--reps", "1", "--json-out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    assert result["size_bytes"] == 4 << 20 and result["receivers"] == 2
    for key in ("raw_tcp_mb_s", "libp2p_stream_mb_s", "shard_protocol_mb_s", "shard_protocol_unstored_mb_s",
                "shard_protocol_default_shard_mb_s", "shard_protocol_default_shard_unstored_mb_s"):
        assert result[key] > 0, key
    # 4 MiB of raw data: the node's default shard (32 MiB) is cut to the whole set, one shard.
    assert result["raw_shard_bytes"] == {"benchmark": result["shard_bytes"], "default": 4 << 20}
    assert result["goodput_ratio"] == round(result["shard_protocol_mb_s"] / result["libp2p_stream_mb_s"], 3)
    for mode in ("swarm", "single_source"):
        figures = result[mode]
        assert figures["integrity_ok"] is True, figures
        assert figures["seconds_to_all"] > 0
    # Single-source: every receiver pulled the whole file from the publisher, and only from it.
    assert result["single_source"]["publisher_uploaded_bytes"] == 2 * result["size_bytes"]
    assert result["single_source"]["receiver_uploaded_bytes"] == [0, 0]
    assert result["swarm"]["publisher_uploaded_bytes"] >= result["size_bytes"]
