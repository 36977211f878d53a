"""Receipts in the simulated swarm: every node that agreed on a round credits the same producers."""

from __future__ import annotations

from protocol.receipts import Credit
from protocol.round import aggregators
from protocol.task_machine import Aggregate
from tests.tasks.swarm_sim import DEADLINE_S, TASK, Swarm


def credits(sim, name):
    return {e.round: e.credits for n, e in sim.closed if n == name}


def test_every_node_credits_every_member_for_every_slice_of_every_round():
    sim = Swarm(["a", "b", "c", "d"], rounds=4, slices=2, min_members=4)
    sim.run_until(sim.all_done, 60)
    everyone = tuple(Credit(p, 10, 2) for p in "abcd")
    assert all(credits(sim, n) == {r: everyone for r in range(4)} for n in "abcd")
    assert not sim.ledger_disagreements()


def test_a_dead_member_is_credited_for_nothing_after_its_last_update():
    sim = Swarm(["a", "b", "c", "d"], rounds=5, slices=2, min_members=2)
    sim.run_until(lambda: sim.rounds_done("a") >= 2, 30)
    sim.kill("d")
    sim.run_until(sim.all_done, 120)
    got = credits(sim, "a")
    assert all(c is not None for c in got.values())
    assert {x.producer for x in got[4]} == {"a", "b", "c"}
    assert not sim.ledger_disagreements()


def test_a_round_that_kept_its_weights_credits_no_one():
    names = ["a", "b", "c", "d"]
    agg = aggregators(TASK, 0, 0, names, 1)[0]
    sim = Swarm(names, rounds=1, slices=1, k=1)
    sim.mute.add(agg)  # it crashes the moment it should aggregate: no aggregate, the round keeps θ_0
    sim.run_until(lambda: any(isinstance(e, Aggregate) for _, e in sim.events), 30)
    sim.kill(agg)
    sim.run_until(sim.all_done, 3 * DEADLINE_S)
    closed = [e for n, e in sim.closed if n != agg]
    assert closed and all(e.failed and e.credits == () for e in closed)


def test_a_joiner_credits_the_rounds_it_heard_every_update_of_like_the_members_and_is_credited_itself():
    sim = Swarm(["a", "b", "c"], rounds=8)
    sim.run_until(lambda: sim.rounds_done("a") >= 3, 30)
    sim.add("e")
    sim.run_until(sim.all_done, 60)
    late = credits(sim, "e")
    assert late[7] == credits(sim, "a")[7] and "e" in {x.producer for x in late[7]}
    assert not sim.ledger_disagreements()


def test_honest_nodes_ledgers_agree_though_a_quarter_forge_their_aggregates():
    names = [f"n{i:02d}" for i in range(12)]
    sim = Swarm(names, rounds=6, slices=3, k=2, min_members=7, forge={"n01", "n05", "n09"}, seed=4)
    sim.run_until(sim.all_done, 300)
    honest = [n for n in names if n not in sim.forge]
    assert not sim.ledger_disagreements(), sim.ledger_disagreements()
    assert all(any(c for c in credits(sim, n).values()) for n in honest)
