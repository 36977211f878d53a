"""scripts/bench_compression.py at a tiny size: the JSON keys, per-arm seeds, and a clear error for an unknown arm."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/bench_compression.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=110)


def test_every_arm_reports_loss_spread_gaps_and_bytes_over_the_seeds():
    proc = bench("--seeds", "0,1", "--arms", "int8,int2/int4", "--rounds", "1", "--inner-steps", "2",
                 "--pretrain-steps", "0", "--workers", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert set(report["arms"]) == {"fp32", "int8", "int2/int4"} and len(report["ddp"]["losses"]) == 2
    for arm in report["arms"].values():
        assert len(arm["losses"]) == 2 and arm["loss_spread"] >= 0
        assert {"gap_vs_ddp_pct", "gap_vs_fp32_diloco_pct", "bytes_per_node", "fewer_bytes_than_ddp"} <= set(arm)
    assert report["arms"]["int2/int4"]["bytes_per_node"] < report["arms"]["int8"]["bytes_per_node"]
    assert report["arms"]["fp32"]["gap_vs_fp32_diloco_pct"] == 0.0


def test_an_unknown_arm_is_named_in_the_error():
    proc = bench("--arms", "int8/topk")
    assert proc.returncode == 2 and "not known: ['int8/topk']" in proc.stderr and "Traceback" not in proc.stderr
