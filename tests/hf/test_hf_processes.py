"""Three real node processes fine-tune a tiny random Llama (LoRA, full, DPO) on a published dataset; the export loads;
and a fourth that replays its first LoRA update is proven untrained by the training checks and banned everywhere."""

import json

import pytest

from node.tasks import training_check
from scripts.demo_finetune import ENV, run_demo, shoal, task_fields, wait_for
from scripts.local_swarm import Swarm
from scripts.swarm_task import TaskRun
from scripts.tiny_hf import make_model_dir, text_records, write_jsonl
from tests.integration.test_trust_processes import proven_untrained_and_banned

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(480)
def test_three_nodes_lora_fine_tune_and_the_export_matches_the_swarm(tmp_path):
    report = run_demo(tmp_path, method="lora", rounds=5, inner_steps=15)
    losses = report["eval_loss_by_round"]
    assert report["rounds"] == 5 and report["hashes_agree"], report
    assert report["slices_screened_out"] == 0, report  # honest LoRA updates are neither empty nor copies
    # Each honest update checked on its own batches by another node's trainer child, and none accused.
    checks = report["training_checks"]
    assert checks["passed"] >= 4 and checks["untrained"] == checks["confirmed"] == checks["refuted"] == 0, checks
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


@pytest.mark.timeout(600)
def test_a_free_rider_replaying_its_first_lora_update_is_proven_untrained_and_banned_everywhere(tmp_path):
    # Three honest nodes and one that sends its first round's LoRA update again every round. The replays pass the
    # screen; the training checks find them: its checker's trainer child measures each on the batches it drew,
    # proves it to the others, each of whom measures it again, and every honest node bans it at the second finding.
    model_dir = make_model_dir(tmp_path / "tiny-llama", arch="llama", seed=0)
    data_file = write_jsonl(tmp_path / "data.jsonl", text_records(400, seed=5))
    swarm = Swarm(4, tmp_path / "swarm", env=ENV)
    other = swarm.nodes[3]
    other.module, other.env = "tests.integration.hostile_node", {"HOSTILE_ATTACK": "stale"}
    honest, rounds = swarm.nodes[:3], 6
    try:
        swarm.start(watch_interval_s=0.3)
        wait_for(swarm, swarm.all_see_all, 90, "every node sees the others")
        url = ["--data-dir", str(swarm.nodes[0].data_dir)]
        model = json.loads(shoal("model", "publish", str(model_dir), "--json", *url))
        data = json.loads(shoal("dataset", "publish", str(data_file), "--json", *url))
        fields = task_fields(recipe="hf-causal-lm", method="lora", model=model, data=data, rounds=rounds,
                             inner_steps=15, nodes=4)
        run = TaskRun(swarm, {**fields, "min_members": 3})
        swarm.task_id = run.publish()
        wait_for(swarm, lambda: all(run.mine(n).get("phase") == "finished" for n in honest), rounds * 60 + 180,
                 "the honest nodes finish")
        for node in honest:
            node.status = node.call("/status")
    finally:
        swarm.stop()
    checks = proven_untrained_and_banned(honest, other, run, rounds)
    assert all(f["gain"] < training_check.UNTRAINED_GAIN_HF["lora"] for c in checks for f in c["findings"]), checks
