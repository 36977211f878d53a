"""Real node processes against a hostile one: a member that forges its aggregates is caught by
recomputation, proven and banned on every honest node, and nothing it forged is applied."""

import json

import pytest

from scripts.local_swarm import Swarm
from scripts.swarm_task import TaskRun
from tests.integration.test_task_processes import ENV, ledger_by_round, tiny_fields, wait_for

pytestmark = [pytest.mark.slow]

ROUNDS = 6


@pytest.mark.timeout(300)
def test_a_forging_aggregator_is_proven_banned_everywhere_and_never_applied(tmp_path):
    swarm = Swarm(4, tmp_path, env=ENV)
    forger = swarm.nodes[3]
    forger.module, forger.env = "tests.integration.hostile_node", {"HOSTILE_ATTACK": "forge"}
    honest = swarm.nodes[:3]
    try:
        swarm.start(watch_interval_s=0.3)
        wait_for(swarm.all_see_all, 60, "every node sees the others", swarm)
        run = TaskRun(swarm, {**tiny_fields(ROUNDS, inner_steps=20), "aggregators_per_shard": 2})
        swarm.task_id = run.publish()
        wait_for(lambda: all(run.mine(n).get("phase") == "finished" for n in honest), 200,
                 "the honest nodes finish", swarm)
        for node in honest:
            node.status = node.call("/status")
    finally:
        swarm.stop()
    bad = forger.peer_id
    tasks = [node.status["task"] for node in honest]
    for task in tasks:
        assert task["banned"] == [bad], task["banned"]
    # Proven: the nodes that recomputed a forged aggregate say so, naming what its inputs gave.
    found = [f for task in tasks for f in task["forgeries"]]
    assert found and all(f["aggregator"] == bad and f["announced"] != f["recomputed"] for f in found)
    assert any(f["found_here"] for f in found)
    assert all(bad in node.status["banned_peers"] for node in honest)
    # Nothing forged was applied: the honest nodes agree on every round and their loss falls as it
    # does without an attacker (a -10x aggregate applied once sends it up by orders of magnitude).
    rounds = weights_by_round(tasks)
    assert sorted(rounds) == list(range(ROUNDS)) and all(len(v) == 1 for v in rounds.values()), rounds
    losses = [x for _, x in tasks[0]["eval_losses"]]
    assert losses and losses[-1] < losses[0] and max(losses) < losses[0] * 1.05, losses
    # What checking cost: recomputations and their seconds beside the training's (shown with -s).
    assert sum(task["verifications"] for task in tasks) >= 1
    print(json.dumps({"verify_seconds": [task["verify_seconds"] for task in tasks],
                      "verifications": [task["verifications"] for task in tasks],
                      "train_seconds": [task["train_seconds"] for task in tasks],
                      "eval_losses": losses}))
    logs = [(node.data_dir / "node.log").read_text() for node in honest]
    assert any("does not match the updates it lists" in text for text in logs)


HOSTILE_ROUNDS = 8


def weights_by_round(tasks: list[dict]) -> dict[int, set[str]]:
    """The weights hashes the given nodes' task statuses report for each round."""
    rounds: dict[int, set[str]] = {}
    for task in tasks:
        for row in task["agreement"]:
            rounds.setdefault(row["round"], set()).add(row["weights_hash"])
    return rounds


def hostile_run(tmp_path, attack: str, **fields):
    """Three honest node processes and one making ``attack`` (tests/integration/hostile_node.py) train the demo
    task; (honest, the hostile one, run)."""
    swarm = Swarm(4, tmp_path, env=ENV)
    other = swarm.nodes[3]
    other.module, other.env = "tests.integration.hostile_node", {"HOSTILE_ATTACK": attack}
    honest = swarm.nodes[:3]
    try:
        swarm.start(watch_interval_s=0.3)
        wait_for(swarm.all_see_all, 60, "every node sees the others", swarm)
        run = TaskRun(swarm, {**tiny_fields(HOSTILE_ROUNDS, inner_steps=20), **fields})
        swarm.task_id = run.publish()
        wait_for(lambda: all(run.mine(n).get("phase") == "finished" for n in honest), 200,
                 "the honest nodes finish", swarm)
        for node in honest:
            node.status = node.call("/status")
    finally:
        swarm.stop()
    return honest, other, run


def screened_out_and_never_credited(honest, other, run, reason: str, charged: bool = True) -> list[float]:
    """The honest aggregators left the hostile node's slices out for ``reason`` (and, if it is ``charged``, banned
    it), no honest ledger credits it, the honest nodes agree on every round and their held-out loss falls; the
    losses."""
    tasks = [node.status["task"] for node in honest]
    # Which honest nodes aggregate its slices, and for how long before they ban it, is the rendezvous hash's
    # choice: some may never have to.
    assert sum(task["screened"].get(reason, 0) for task in tasks) >= 1, [task["screened"] for task in tasks]
    assert all(set(task["screened"]) <= {reason} for task in tasks), [task["screened"] for task in tasks]
    # Charged alike: every honest node applied aggregates that say so, charged it from them, and banned it.
    assert all(task["screened_applied"].get(reason, 0) >= 1 for task in tasks), [t["screened_applied"] for t in tasks]
    assert all(set(task["screened_applied"]) == {reason} for task in tasks), [t["screened_applied"] for t in tasks]
    assert all((other.peer_id in node.status["banned_peers"]) == charged for node in honest)
    credited = {r.producer for node in honest for rs in ledger_by_round(node, run.task_id).values() for r in rs}
    assert credited == {node.peer_id for node in honest}, credited
    print(json.dumps({"screened": [task["screened"] for task in tasks],
                      "screened_applied": [task["screened_applied"] for task in tasks],
                      "eval_losses": tasks[0]["eval_losses"]}))
    rounds = weights_by_round(tasks)
    assert sorted(rounds) == list(range(HOSTILE_ROUNDS)) and all(len(v) == 1 for v in rounds.values()), rounds
    losses = [x for _, x in tasks[0]["eval_losses"]]
    assert losses and losses[-1] < losses[0], losses
    return losses


@pytest.mark.timeout(300)
def test_a_free_rider_publishing_zeros_is_screened_out_charged_and_never_credited(tmp_path):
    screened_out_and_never_credited(*hostile_run(tmp_path, "zeros"), "empty")


@pytest.mark.timeout(300)
def test_a_sign_flipping_trainer_is_screened_out_charged_and_never_credited(tmp_path):
    # Never credited means none of its slices went into the weights: the loss falls as without it (a single
    # round's loss may still rise, as in clean runs of this tiny task).
    screened_out_and_never_credited(*hostile_run(tmp_path, "sign_flip"), "opposed")


@pytest.mark.timeout(300)
def test_a_trainer_pouring_noise_into_its_update_is_screened_out_charged_and_never_credited(tmp_path):
    # Gaussian noise of 10x its update's rms: about 10x the others' norm, where no honest slice comes near.
    screened_out_and_never_credited(*hostile_run(tmp_path, "gaussian"), "outsized")


@pytest.mark.timeout(300)
def test_an_update_crafted_inside_the_honest_spread_is_screened_out_every_round_and_never_credited(tmp_path):
    # ALIE: the honest updates' mean plus one standard deviation, value by value. Its direction and size are an
    # honest update's; it sits above the median nearly everywhere, where an honest one is as often below. Left
    # out every round, not charged (an honest update can be pushed to one side too), and so never banned.
    # One slice of the whole model: with two, the second holds the byte and position embeddings, where honest updates
    # are sparse and uneven (rows of bytes no batch held stay 0), and a crafted slice is one-sided at fewer of its
    # values (0.74 there against 0.95 in the first, 0.86 over the whole model, in-process at round 0 with int4); on
    # real nodes it fell under the screen's bound in about 1 run in 5 (one round-0 slice went in and was credited).
    screened_out_and_never_credited(*hostile_run(tmp_path, "alie", aggregation_shards=1), "one_sided", charged=False)


def proven_untrained_and_banned(honest, other, run, rounds: int) -> list[dict]:
    """The honest nodes' training checks found ``other``'s updates untrained (its checker) and confirmed them (the
    others), accused nobody else and were refuted by none; every honest node banned it at its second finding,
    credited it for no round after, agreed on every round's weights and saw the held-out loss fall. The checks."""
    tasks = [node.status["task"] for node in honest]
    checks = [task["training_checks"] for task in tasks]
    print(json.dumps({"training_checks": checks, "eval_losses": tasks[0]["eval_losses"]}))
    assert all(c["enabled"] for c in checks)
    assert sum(c["untrained"] for c in checks) >= 1 and sum(c["confirmed"] for c in checks) >= 1, checks
    assert all(c["refuted"] == 0 for c in checks), checks
    assert sum(c["passed"] for c in checks) >= 2, checks  # honest updates were measured and passed
    assert {f["producer"] for c in checks for f in c["findings"]} == {other.peer_id}, checks
    # Every honest node judged the findings itself (found or confirmed), so every one of them banned it.
    assert all(len({f["round"] for f in c["findings"]}) >= 2 for c in checks), checks
    assert all(other.peer_id in node.status["banned_peers"] for node in honest)
    assert all(not set(node.status["banned_peers"]) & {n.peer_id for n in honest} for node in honest)
    # Credited for no round after its ban. A check of round r runs in the checker's trainer child after round
    # r+1's training, so the ban at the last finding can land once round r+1 is aggregated: that round at most.
    last = max(f["round"] for c in checks for f in c["findings"])
    credited = {r.round for node in honest for rs in ledger_by_round(node, run.task_id).values() for r in rs
                if r.producer == other.peer_id}
    assert all(r <= last + 1 for r in credited), (credited, last)
    by_round = weights_by_round(tasks)
    assert sorted(by_round) == list(range(rounds)) and all(len(v) == 1 for v in by_round.values()), by_round
    losses = [x for _, x in tasks[0]["eval_losses"]]
    assert losses and losses[-1] < losses[0], losses
    return checks


@pytest.mark.timeout(300)
def test_a_free_rider_replaying_its_first_update_is_proven_untrained_and_banned_everywhere(tmp_path):
    # Its replays pass the screen (a real update, of a real size and direction), so the training checks must
    # find them: its checker measures each on the batches it drew, proves it to the others, and every honest node
    # measures it again and bans it at the second finding.
    honest, other, run = hostile_run(tmp_path, "stale")
    proven_untrained_and_banned(honest, other, run, HOSTILE_ROUNDS)


@pytest.mark.timeout(300)
def test_a_free_rider_copying_another_producer_is_told_from_its_original_and_banned_alone(tmp_path):
    # An exact copy: the screen leaves it out with its original every round (neither charged, since the screen
    # cannot tell which is which); the training checks measure the one update on both producers' batches.
    honest, other, run = hostile_run(tmp_path, "copy")
    tasks = [node.status["task"] for node in honest]
    checks = [task["training_checks"] for task in tasks]
    print(json.dumps({"training_checks": checks, "screened": [t["screened"] for t in tasks],
                      "eval_losses": tasks[0]["eval_losses"]}))
    findings = [f for c in checks for f in c["findings"]]
    assert findings and {f["producer"] for f in findings} == {other.peer_id}, checks
    assert all(f["copy_of"] in {n.peer_id for n in honest} for f in findings), findings
    assert all(c["refuted"] == 0 for c in checks), checks
    assert all(other.peer_id in node.status["banned_peers"] for node in honest)
    assert all(not set(node.status["banned_peers"]) & {n.peer_id for n in honest} for node in honest)
    rounds = weights_by_round(tasks)
    assert sorted(rounds) == list(range(HOSTILE_ROUNDS)) and all(len(v) == 1 for v in rounds.values()), rounds
    # Credited for nothing it copied: its slices were left out as copies until it was banned.
    credited = {r.round for node in honest for rs in ledger_by_round(node, run.task_id).values() for r in rs
                if r.producer == other.peer_id}
    assert not credited, credited


@pytest.mark.timeout(300)
def test_a_producer_signing_two_updates_of_each_round_is_banned_everywhere_and_the_honest_agree(tmp_path):
    # Both versions are real updates its slices back: aggregators that heard different ones first would combine
    # different inputs. Every honest node hears both (gossip relays them) and bans it as the second arrives.
    honest, other, run = hostile_run(tmp_path, "two_updates")
    tasks = [node.status["task"] for node in honest]
    assert all(task["banned"] == [other.peer_id] for task in tasks), [task["banned"] for task in tasks]
    assert all(other.peer_id in node.status["banned_peers"] for node in honest)
    assert all(not set(node.status["banned_peers"]) & {n.peer_id for n in honest} for node in honest)
    rounds = weights_by_round(tasks)
    assert sorted(rounds) == list(range(HOSTILE_ROUNDS)) and all(len(v) == 1 for v in rounds.values()), rounds
    logs = [(node.data_dir / "node.log").read_text() for node in honest]
    assert all("two updates of round" in text for text in logs)


@pytest.mark.timeout(300)
def test_a_member_that_joins_and_never_trains_holds_one_round_to_its_deadline_and_none_after(tmp_path):
    """A member that never sends an update is waited for once: a round closes when the members that deliver
    have, and it is never waited for again, however often it re-syncs and joins (a join costs it nothing)."""
    honest, other, run = hostile_run(tmp_path, "silent")
    tasks = [node.status["task"] for node in honest]
    rounds = weights_by_round(tasks)
    assert sorted(rounds) == list(range(HOSTILE_ROUNDS)) and all(len(v) == 1 for v in rounds.values()), rounds
    # It was counted: some round's members include it (three honest nodes and it).
    assert any(row["members"] == 4 for task in tasks for row in task["agreement"]), [t["agreement"] for t in tasks]
    logs = [(node.data_dir / "node.log").read_text() for node in honest]
    waited_out = [text.count("collecting ran to its deadline") for text in logs]
    assert all(n <= 1 for n in waited_out), waited_out
    # Every honest node says whom it no longer waits for (`shoal task show`, /status).
    assert all(list(task["not_waited"]) == [other.peer_id] for task in tasks), [t["not_waited"] for t in tasks]
    credited = {r.producer for node in honest for rs in ledger_by_round(node, run.task_id).values() for r in rs}
    assert credited == {node.peer_id for node in honest}, credited
    losses = [x for _, x in tasks[0]["eval_losses"]]
    assert losses and losses[-1] < losses[0], losses
    print(json.dumps({"collecting_ran_to_deadline": waited_out,
                      "members": [[row["members"] for row in task["agreement"]] for task in tasks],
                      "round_s": [[row["round_s"] for row in task["agreement"]] for task in tasks]}))
