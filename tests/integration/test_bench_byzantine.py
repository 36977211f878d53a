"""A bounded slice of scripts/bench_byzantine.py: the clean run and a free-rider on 4 node processes, 3 rounds."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(420)
def test_the_benchmark_reports_every_field_and_the_free_rider_is_excluded(tmp_path):
    out = tmp_path / "byzantine.json"
    subprocess.run([sys.executable, "scripts/bench_byzantine.py", "--quick", "--attacks", "zeros", "--rounds", "3", "--seeds", "1",
                    "--json-out", str(out)], cwd=ROOT, check=True, timeout=400, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert set(report["attacks"]) == {"clean", "zeros"} and report["verification_share"] is not None
    zeros, clean = report["attacks"]["zeros"], report["attacks"]["clean"]
    assert zeros["malicious_excluded_share"] == 1.0 and zeros["honest_excluded_share"] == 0.0, zeros
    assert clean["honest_excluded_share"] == 0.0 and clean["loss_vs_clean_pct"] == 0.0, clean
    assert zeros["time_to_ban_s"] is None or zeros["time_to_ban_s"] > 0
    runs = [run for attack in report["setups"]["4x1"].values() for run in attack["runs"]]
    assert len(runs) == 2 and all(r["hashes_agree"] and r["rounds"] == 3 for r in runs), runs
