"""A bounded slice of scripts/bench_byzantine.py: the baselines, an over-claimer and an equivocating aggregator on 4
node processes, 3 rounds
(the free-rider and the sign-flipper have their own process tests, tests/integration/test_trust_processes.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(420)
def test_the_benchmark_reports_every_field_and_provable_liars_are_banned_everywhere(tmp_path):
    out = tmp_path / "byzantine.json"
    subprocess.run([sys.executable, "scripts/bench_byzantine.py", "--quick", "--attacks", "overclaim,equivocate", "--rounds", "3", "--seeds", "1",
                    "--json-out", str(out)], cwd=ROOT, check=True, timeout=400, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert set(report["attacks"]) == {"clean", "honest_only", "overclaim", "equivocate"}
    assert report["verification_share"] is not None
    claim, clean = report["attacks"]["overclaim"], report["attacks"]["clean"]
    # Its first update is proof enough: every honest node bans it in round 0, and nothing of it is applied.
    assert claim["malicious_excluded_share"] == 1.0 and claim["honest_excluded_share"] == 0.0, claim
    assert clean["honest_excluded_share"] == 0.0 and clean["loss_vs_clean_pct"] == 0.0, clean
    assert claim["time_to_ban_s"] is not None and claim["time_to_ban_s"] > 0, claim
    # Two results signed for one aggregate: every honest node that hears both bans it, whatever it applied.
    assert report["attacks"]["equivocate"]["time_to_ban_s"] is not None, report["attacks"]["equivocate"]
    runs = [run for attack in report["setups"]["4x1"].values() for run in attack["runs"]]
    assert report["attacks"]["honest_only"]["loss_vs_honest_only_pct"] == 0.0
    assert len(runs) == 4 and all(r["hashes_agree"] and r["rounds"] == 3 for r in runs), runs
