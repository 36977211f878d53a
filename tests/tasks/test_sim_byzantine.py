"""scripts/sim_byzantine.py at a small size: its JSON, and that nothing forged is applied."""

import json

import pytest

from scripts import sim_byzantine


def test_the_byzantine_simulation_reports_no_forged_result_applied(capsys):
    assert sim_byzantine.main(["--nodes", "20", "--seeds", "1,2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["all_agreed"] and report["forged_applied"] == 0 and report["honest_banned"] == 0
    for run in report["runs"]:
        assert run["forgers"] == 5 and run["aggregates_applied"] > 0
        assert set(run) >= {"rounds_failed_share", "recomputations_per_honest_node_round", "cpu_s"}


def test_a_share_of_forgers_past_a_half_is_refused(capsys):
    with pytest.raises(SystemExit):
        sim_byzantine.main(["--share", "0.6"])
    assert "--share" in capsys.readouterr().err
