"""Task machines with producers the screen leaves out: an aggregate says whom it screened and why, every
node charges them alike from the aggregates it applies, nobody waits for an aggregator once an aggregate has
decided on every update it holds, and a screen claim the slices do not bear out is a proven forgery."""

from __future__ import annotations

import pytest

from protocol.task_machine import Apply, Overdue, ScreenedOut, Stage
from tests.tasks.swarm_sim import Swarm


def _honest(sim, bad):
    return [n for n in sim.alive() if n not in bad]


def _charges(sim, name) -> list[tuple[int, int, tuple]]:
    return sorted((e.round, e.slice, e.producers) for n, e in sim.charged if n == name)


@pytest.mark.parametrize("seed", range(3))
def test_a_screened_producer_that_never_aggregates_is_charged_alike_everywhere_and_stalls_no_round(seed):
    names = ["a", "b", "c", "d"]
    rider = names[seed]
    sim = Swarm(names, rounds=8, slices=2, k=2, min_members=3, seed=seed)
    sim.screen[rider] = "empty"
    sim.mute.add(rider)  # its aggregates never come: only a settled slice keeps the others from waiting for them
    honest = _honest(sim, {rider})
    took = sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 300)
    assert not [e for n, e in sim.events if n in honest and isinstance(e, Overdue)], "someone waited for the rider"
    assert took < 8 * 10, took  # 8 rounds of a few simulated seconds each, never a 30 s deadline
    # Its work never counted, so once the others' had, no honest node handed it a slice to aggregate.
    for n in honest:
        rounds = sim.machines[n].rounds_seen
        assert all(rider not in a for r, rec in rounds.items() if r >= 1 for a in rec.aggregators.values()), n
    charges = [_charges(sim, n) for n in honest]
    assert charges[0] and all(c == charges[0] for c in charges), charges
    assert {p for _, _, ps in charges[0] for p in ps} == {(rider, "empty")}
    assert {r for r, _, _ in charges[0]} == set(range(8)) and len(charges[0]) == 8 * 2
    assert all(rider not in a.included for n, e in sim.events if n in honest and isinstance(e, Apply) for a in e.chosen)
    assert len({sim.history[n][7] for n in honest}) == 1


def test_an_aggregator_that_calls_an_honest_producer_screened_is_proven_and_nobody_is_charged():
    names = ["a", "b", "c", "d", "e"]
    framer = "e"
    sim = Swarm(names, rounds=8, slices=2, k=2, min_members=3)
    sim.frame.add(framer)
    honest = _honest(sim, {framer})
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 300)
    applied = [a for n, e in sim.events if n in honest and isinstance(e, Apply) for a in e.chosen]
    assert applied and not [a for a in applied if a.screened], "a false screen claim was applied"
    assert not [c for c in sim.charged if c[0] in honest], sim.charged
    for n in honest:
        assert sim.machines[n].audit.banned == {framer}, (n, sim.machines[n].audit.banned)
    assert len({sim.history[n][7] for n in honest}) == 1


def test_screen_claims_do_not_change_what_a_clean_round_does():
    sim = Swarm(["a", "b", "c", "d"], rounds=4, slices=2, k=2, min_members=3)
    sim.run_until(sim.all_done, 120)
    assert not sim.charged and sim.verifications == 0


def test_new_identities_whose_work_never_counts_cannot_outvote_the_members_who_did_it():
    honest, sybils = ["a", "b", "c"], ["s1", "s2", "s3", "s4"]
    sim = Swarm(honest + sybils, rounds=6, slices=2, k=2, min_members=3)
    for s in sybils:
        sim.screen[s] = "empty"  # they send updates (they are members) that never go into an applied aggregate
        sim.lie.add(s)  # and all announce the same other weights, four votes against three
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 300)
    for n in honest:
        assert set(sim.machines[n].contributed) == set(honest), (n, sim.machines[n].contributed)
    # Every round the honest nodes closed agreed with their own weights: none was pulled to the crowd's.
    closed = [e for n, e in sim.closed if n in honest]
    assert closed and all(e.agreed for e in closed), [e for e in closed if not e.agreed]
    assert len({sim.history[n][5] for n in honest}) == 1


def test_members_whose_work_stopped_counting_long_ago_lose_their_votes():
    """Four members contribute at first, then send only empty updates; once CONTRIBUTED_ROUNDS have passed
    they all announce other weights, four votes against three. Their old work no longer counts."""
    from protocol.task_machine import CONTRIBUTED_ROUNDS
    honest, quitters = ["a", "b", "c"], ["q1", "q2", "q3", "q4"]
    sim = Swarm(honest + quitters, rounds=CONTRIBUTED_ROUNDS + 8, slices=2, k=2, min_members=3)
    sim.run_until(lambda: all(sim.machines[n].current >= 2 for n in honest), 300)
    assert set(quitters) <= set(sim.machines["a"].contributed)  # their early work counted
    for q in quitters:
        sim.screen[q] = "empty"
    quit_at = max(sim.machines[n].current for n in honest)
    sim.run_until(lambda: all(sim.machines[n].current > quit_at + CONTRIBUTED_ROUNDS for n in honest), 3000)
    lying_from = max(sim.machines[n].current for n in honest)
    sim.lie.update(quitters)
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 3000)
    late = [e for n, e in sim.closed if n in honest and e.round >= lying_from]
    assert late and all(e.agreed for e in late), [e for e in late if not e.agreed]
    assert len({sim.history[n][CONTRIBUTED_ROUNDS + 7] for n in honest}) == 1
    assert len(sim.machines["a"].contributed) <= 2 * 7 + 16  # the record is pruned, not grown for ever
