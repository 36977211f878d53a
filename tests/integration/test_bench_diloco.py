"""scripts/bench_diloco.py end to end at a tiny size: the JSON keys, both starts, 2-bit updates with error feedback
through a real swarm, bytes counted on the wire."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_bench_diloco_reports_gaps_bytes_on_the_wire_and_training_shares(tmp_path):
    out = tmp_path / "diloco.json"
    proc = subprocess.run([sys.executable, "scripts/bench_diloco.py", "--workers", "2", "--rounds", "2",
                           "--inner-steps", "5", "--pretrain-steps", "10", "--seeds", "1,2", "--starts", "warm,scratch",
                           "--compressions", "int2", "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("loss_gap_pct", "loss_gap_pct_scratch", "bytes_ratio", "bytes_ratio_bf16", "train_share_min",
                "hashes_agree", "targets_met"):
        assert key in report, key
    assert report["hashes_agree"] is True and report["default_arm"] == "int2" and set(report["arms"]) == {"int2"}
    assert [(r["start"], r["seed"]) for r in report["runs"]] == [("warm", 1), ("warm", 2), ("scratch", 1), ("scratch", 2)]
    assert report["by_start"]["warm"]["loss_gap_pct"]["n"] == 2
    for run in report["runs"]:
        d = run["diloco"]
        assert run["compression"] == "int2" and d["weights_hashes_agree"]
        # The wire carries the streams' payload and more (gossip, handshakes, framing), on every node.
        for peer, wire in d["bytes_wire_by_node"].items():
            stream = d["bytes_libp2p_by_node"][peer]
            assert wire["sent"] > stream["sent"] and wire["received"] > stream["received"], (wire, stream)
        assert d["bytes_per_node"] == max(w["sent"] + w["received"] for w in d["bytes_wire_by_node"].values())
        assert 0 < d["train_share_min"] <= 1 and len(d["train_share_by_node"]) == 2
        assert run["bytes_ratio"] == pytest.approx(run["ddp"]["bytes_per_node_fp32"] / d["bytes_per_node"], rel=0.01)
    # The two seeds are two different runs, not one run twice.
    warm = [r for r in report["runs"] if r["start"] == "warm"]
    assert warm[0]["diloco"]["eval_loss"] != warm[1]["diloco"]["eval_loss"]
