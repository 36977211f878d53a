"""A bounded slice of scripts/screen_margins.py: honest updates from scratch and from a warm start stay clear of
every screen threshold, and the screen leaves none of them out."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(300)
def test_honest_updates_clear_the_screen_with_room_to_spare(tmp_path):
    out = tmp_path / "margins.json"
    subprocess.run([sys.executable, "scripts/screen_margins.py", "--producers", "4", "--inner-steps", "4", "--rounds", "2",
                    "--seeds", "1", "--json-out", str(out)], cwd=ROOT, check=True, timeout=280, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    worst = report["worst"]
    assert worst["honest_slices_screened_out"] == 0, worst
    assert worst["max_pairwise_cosine"] < report["thresholds"]["duplicate_cosine"], worst
    assert worst["min_median_cosine"] > report["thresholds"]["opposed_cosine"], worst
    assert worst["min_norm_ratio"] > report["thresholds"]["empty_share"], worst
    assert worst["max_norm_ratio"] < report["thresholds"]["outsized_share"], worst
    assert worst["max_one_sided"] < report["thresholds"]["one_sided_share"], worst
    assert report["compression"] == "int4/int4"  # a TOML spec's, when it names none
    assert {r["start"] for r in report["runs"]} == {"scratch", "warm"} and len(report["runs"]) == 2
