"""Three real node processes fine-tune a tiny random Llama (LoRA, full, DPO) on a published dataset; the export loads."""

import pytest

from scripts.demo_finetune import run_demo

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(480)
def test_three_nodes_lora_fine_tune_and_the_export_matches_the_swarm(tmp_path):
    report = run_demo(tmp_path, method="lora", rounds=5, inner_steps=15)
    losses = report["eval_loss_by_round"]
    assert report["rounds"] == 5 and report["hashes_agree"], report
    assert report["slices_screened_out"] == 0, report  # honest LoRA updates are neither empty nor copies
    assert losses[-1] < losses[0] and losses[2] < losses[0], losses
    assert report["export_loads"] and report["logits_match"], report["logits_max_abs_diff"]
    assert report["adapter_loads"] and report["adapter_logits_match"], report["adapter_logits_max_abs_diff"]
    assert report["generated"].startswith("ada has 3 red")
    assert report["num_params_exchanged"] < report["num_params_total"] / 4, report


@pytest.mark.timeout(480)
def test_three_nodes_dpo_with_lora_raise_the_held_out_preference_margin(tmp_path):
    report = run_demo(tmp_path, recipe="hf-dpo", method="lora", rounds=4, inner_steps=10, export=False)
    assert report["rounds"] == 4 and report["hashes_agree"], report
    assert report["slices_screened_out"] == 0, report
    assert report["margin_last"] > report["margin_first"] + 0.1, report
    assert report["eval_loss_last"] < report["eval_loss_first"], report["eval_loss_by_round"]
