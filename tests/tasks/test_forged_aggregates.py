"""Task machines against forging aggregators and unlisted peers: nothing forged is applied, forgers are
proven and banned, proofs are judged by recomputation, and a listed task ignores everyone else."""

from __future__ import annotations

import pytest

from protocol.audit import Accused, FalseAccusation, Forged, Input, Verified, Verify
from protocol.task import AggregateAnnounce, UpdateAnnounce
from protocol.task_machine import Apply, Dissent, FetchState, Overdue, Publish, Stage
from tests.tasks.swarm_sim import TASK, Swarm, truth
from tests.tasks.test_task_machine import churn, final_hashes

def _honest(sim, forgers):
    return [n for n in sim.alive() if n not in forgers]


def _applied_results(sim, names):
    """Every aggregate result each node applied, with the inputs it listed."""
    return [(n, a) for n, e in sim.events if n in names and isinstance(e, Apply) for a in e.chosen]


@pytest.mark.parametrize("seed", range(3))
def test_an_aggregator_that_forges_its_result_is_never_applied_and_is_banned_on_every_node(seed):
    names = ["a", "b", "c", "d"]
    forger = names[seed]
    sim = Swarm(names, rounds=8, slices=2, k=2, min_members=3, forge={forger})
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in _honest(sim, {forger})), 300)
    honest = _honest(sim, {forger})
    applied = _applied_results(sim, honest)
    assert applied and any(a.aggregator != forger for _, a in applied)
    forged = [(n, a) for n, a in applied if a.result_hash != _truth_of(sim, n, a)]
    assert not forged, forged
    for n in honest:
        assert sim.machines[n].audit.banned == {forger}, (n, sim.machines[n].audit.banned)
    assert {f.aggregate.aggregator for n, f in sim.forged if n in honest} == {forger}
    # Honest nodes never accuse each other; the forger, which believes its own results, may, and pays for it.
    assert {e.accuser for n, e in sim.false_accusations if n in honest} <= {forger}
    hashes = {r: {sim.history[n].get(r) for n in honest} for r in range(8)}
    assert all(len(v) == 1 for v in hashes.values()), hashes
    assert not [e for n, e in sim.events if n in honest and isinstance(e, Overdue)], "a ban leaves nobody waiting"


def _truth_of(sim, name, a):
    """What the inputs an applied aggregate lists give (every input is a heard, signed update in the sim)."""
    index = getattr(sim, "_updates_index", None)
    if index is None or index[0] != len(sim.events):
        found = {}
        for _, e in sim.events:
            if isinstance(e, Publish) and isinstance(e.message, UpdateAnnounce):
                u = e.message
                for s, mid in enumerate(u.manifest_ids):
                    found[(u.producer, u.round, s, mid)] = u
        index = sim._updates_index = (len(sim.events), found)
    return truth(a.round, a.slice, [index[1][(p, a.round, a.slice, mid)] for p, mid in zip(a.included, a.inputs)])


@pytest.mark.parametrize("seed", range(3))
def test_a_forgery_heard_before_our_own_aggregate_is_judged_by_it_and_never_applied(seed):
    """The forger aggregates at once, the honest nodes take two simulated seconds: its aggregate arrives before
    theirs is made. Their own result judges it the moment it exists (seen on real nodes: one honest node
    applied the forged aggregate that it had itself aggregated honestly, its verdict being known)."""
    names = ["a", "b", "c", "d"]
    forger = names[seed]
    sim = Swarm(names, rounds=8, slices=2, k=2, min_members=3, forge={forger})
    honest = _honest(sim, {forger})
    sim.aggregate_s.update(dict.fromkeys(honest, 2.0))
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 600)
    assert sim.forged_applied(honest) == 0
    assert all(sim.machines[n].audit.banned == {forger} for n in honest)


def test_the_only_aggregator_of_a_slice_is_caught_by_spot_checks():
    forger = "c"
    sim = Swarm(["a", "b", "c", "d"], rounds=6, slices=2, k=1, min_members=3, forge={forger}, spot_check=1.0)
    honest = _honest(sim, {forger})
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 300)
    assert not [(n, a) for n, a in _applied_results(sim, honest) if a.result_hash != _truth_of(sim, n, a)]
    assert all(sim.machines[n].audit.banned == {forger} for n in honest)


def test_without_spot_checks_nothing_recomputes_aggregates_that_agree():
    sim = Swarm(["a", "b", "c", "d"], rounds=4, slices=2, k=2, min_members=3)
    sim.run_until(sim.all_done, 120)
    assert sim.verifications == 0 and not sim.forged and len(final_hashes(sim)) == 1


@pytest.mark.parametrize("seed", range(3))
def test_new_identities_agreeing_on_a_lie_are_handed_no_slice_and_nothing_forged_is_applied(seed):
    """Four new identities of seven, whose updates are screened out, forge one shared lie and vouch for each
    other. Handed slices as any members, both aggregators of a slice were theirs in about 3 of 10 slices, and
    with no honest aggregate to contradict them the lie passed unchecked (spot checks off here)."""
    honest, sybils = ["a", "b", "c"], ["s1", "s2", "s3", "s4"]
    sim = Swarm(honest, rounds=10, slices=2, k=2, min_members=3, seed=seed)
    sim.run_until(lambda: all(sim.machines[n].current >= 1 for n in honest), 300)
    sim.collude.update(sybils)
    for s in sybils:
        sim.screen[s] = "empty"
        sim.add(s)
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 600)
    assert sim.forged_applied(honest) == 0
    for n in honest:
        assert set(sim.machines[n].contributed) == set(honest)
        rounds = sim.machines[n].rounds_seen
        assert rounds and not {a for rec in rounds.values() for s in rec.aggregators.values() for a in s} & set(sybils)
    assert len({sim.history[n][9] for n in honest}) == 1


def test_a_newcomer_vouching_for_a_members_lie_confirms_nothing():
    """A member whose work counted starts forging once a new identity joins to announce the same aggregates as
    a second opinion, while the honest aggregators are silent. Only the aggregators a round handed the slice to
    vouch, so the lie is recomputed, proven and its aggregator banned; it used to be applied as confirmed."""
    honest, liar, sybil = ["a", "b", "c"], "d", "s1"
    sim = Swarm([*honest, liar, sybil], rounds=8, slices=2, k=2, min_members=3)
    sim.screen[sybil] = "empty"  # a member from the start whose work never counts
    sim.run_until(lambda: all(sim.machines[n].current >= 2 for n in honest), 300)
    sim.collude.update({liar, sybil})
    sim.mute.update(honest)
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 600)
    assert sim.forged_applied(honest) == 0
    assert all(liar in sim.machines[n].audit.banned for n in honest)


def test_an_unconfirmed_aggregate_is_checked_before_the_deadline_even_while_its_co_aggregator_owes_one():
    """A forger that also leaves a producer out never covers every update, so the slice keeps waiting for its
    silent co-aggregator; at the deadline its lie used to be applied unchecked. Now it is recomputed once the
    aggregators' fetching time is over, proven, and its aggregator banned."""
    honest, liar = ["a", "b", "c"], "d"
    sim = Swarm([*honest, liar], rounds=6, slices=2, k=2, min_members=3)
    sim.run_until(lambda: all(sim.machines[n].current >= 2 for n in honest), 300)
    sim.forge.add(liar)
    sim.omit.add(liar)
    sim.mute.update(honest)
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 600)
    assert sim.forged_applied(honest) == 0
    assert all(sim.machines[n].audit.banned == {liar} for n in honest)


def test_a_proof_is_judged_by_recomputing_it_and_a_false_one_charges_its_accuser():
    sim = Swarm(["a", "b", "c"], rounds=4, slices=1, k=1, min_members=3)
    sim.run_until(lambda: sim.rounds_done("a") >= 1 and sim.machines["a"].current >= 1
                  and sim.machines["a"].rounds_seen[sim.machines["a"].current].updates, 30)
    m = sim.machines["a"]
    rec = m.rounds_seen[m.current]
    while len(rec.updates) < 2:
        sim.advance(0.1)
    # One producer's slice alone: an aggregate nobody announced, so no node has recomputed it yet.
    updates = tuple(rec.updates[p] for p in sorted(rec.updates))[:1]
    right = truth(rec.index, 0, updates)
    base = dict(task_id=TASK, round=rec.index, slice=0, included=tuple(u.producer for u in updates),
                inputs=tuple(u.manifest_ids[0] for u in updates), manifest_id=right)
    honest = AggregateAnnounce(aggregator="b", result_hash=right, **base)
    forged = AggregateAnnounce(aggregator="c", result_hash="ee" * 32, **{**base, "manifest_id": "ee" * 32})
    asked = m.handle(Accused(aggregate=forged, accuser="b"), sim.now)
    assert [type(e) for e in asked] == [Verify]
    assert asked[0].inputs == tuple(Input(u.producer, u.manifest_ids[0], u.samples) for u in updates)
    assert m.handle(Accused(aggregate=forged, accuser="b"), sim.now) == []  # one recomputation per aggregate
    out = m.handle(Verified(key=asked[0].key, result_hash=right), sim.now)
    assert [e for e in out if isinstance(e, Forged)] == [Forged(forged, right, prove=False)]
    assert m.audit.banned == {"c"}
    assert m.handle(Accused(aggregate=honest, accuser="c"), sim.now) == []  # a banned peer's word counts for nothing
    lie = m.handle(Accused(aggregate=honest, accuser="e"), sim.now)
    assert [e for e in lie if isinstance(e, FalseAccusation)] == [FalseAccusation("e", honest)]
    assert m.audit.banned == {"c"}
    # A proof about a producer we never heard cannot be judged and charges nobody.
    unknown = AggregateAnnounce(aggregator="b", result_hash=right, **{**base, "included": ("zz",)})
    assert m.handle(Accused(aggregate=unknown, accuser="e"), sim.now) == []


def _byzantine_churn(n: int, seed: int):
    """n nodes of which a quarter forge every aggregate they make (each its own lie), with joins, deaths,
    restarts and a partition that heals: the honest nodes agree every round and apply nothing forged."""
    import random
    names = [f"node-{i:04d}" for i in range(n)]
    forgers = set(random.Random(seed).sample(names, n // 4))
    sim = Swarm(names, rounds=9, slices=4, k=2, min_members=n // 2 + 1, forge=forgers)
    churn(sim, names, rng=random.Random(seed), joins=max(1, n // 50), kills=n * 3 // 100, restarts=max(1, n // 100),
          split_share=0.3)
    honest = [x for x in sim.machines if x not in forgers]
    applied = _applied_results(sim, honest)
    assert applied and not [(x, a) for x, a in applied if a.aggregator in forgers and a.result_hash != _truth_of(sim, x, a)]
    assert all(sim.machines[x].audit.banned <= forgers for x in honest), "an honest node was banned"
    assert all(sim.machines[x].audit.banned for x in honest if x in sim.alive() and not x.startswith("late"))
    return sim


def test_sixty_nodes_a_quarter_of_them_forging_agree_and_apply_nothing_forged():
    _byzantine_churn(60, seed=2)


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 40 s of CPU (140 s before the recomputation and paused-count caches)
def test_two_hundred_nodes_a_quarter_of_them_forging_agree_and_apply_nothing_forged():
    _byzantine_churn(200, seed=2)


def test_a_task_listing_its_trainers_ignores_everyone_else_whatever_they_claim():
    sim = Swarm(["a", "b", "c", "x"], rounds=4, slices=2, k=2, min_members=3, lie={"x"}, forge={"x"})
    sim.inflate["x"] = 1_000
    for name in "abc":
        sim.machines[name].trainers = frozenset("abc")
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in "abc"), 120)
    closed = [e for n, e in sim.closed if n in "abc"]
    assert closed and all(e.members == 3 and e.agreed and not e.failed for e in closed)
    assert not [e for n, e in sim.events if n in "abc" and isinstance(e, FetchState) and e.head.peer_id == "x"]
    assert all(sim.machines[n].dropped["not_listed"] > 0 for n in "abc")
    assert not sim.forged, "x's aggregates were never even considered"


def test_a_producer_that_overclaims_its_samples_is_banned_everywhere_and_holds_no_round():
    from protocol.task_machine import Impossible
    sim = Swarm(["a", "b", "c", "x"], rounds=5, slices=2, k=2, min_members=3)
    sim.overclaim.add("x")
    honest = ["a", "b", "c"]
    took = sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 300)
    assert took < 5 * 10, took  # no round waited out its 30 s deadline for the claimant
    assert not [e for n, e in sim.events if n in honest and isinstance(e, Overdue)]
    refused = [(n, e) for n, e in sim.events if isinstance(e, Impossible)]
    assert sorted(n for n, _ in refused) == honest, refused  # once per node: banned from then on
    assert all(e.peer_id == "x" and "claimed 1001 samples" in e.reason for _, e in refused)
    assert all(sim.machines[n].audit.banned == {"x"} for n in honest)
    assert not [a for n, e in sim.events if n in honest and isinstance(e, Apply) for a in e.chosen
                if "x" in a.included]
    assert len({sim.history[n][4] for n in honest}) == 1


@pytest.mark.parametrize("seed", range(3))
def test_a_producer_signing_two_updates_of_a_round_is_banned_by_every_node_and_the_honest_agree(seed):
    # Each half of the swarm hears its own version first: aggregators would combine different inputs.
    from protocol.task_machine import Impossible
    sim = Swarm(["a", "b", "c", "d", "x"], rounds=6, slices=2, k=2, min_members=3, seed=seed)
    sim.two_updates.add("x")
    honest = ["a", "b", "c", "d"]
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 300)
    refused = [(n, e) for n, e in sim.events if isinstance(e, Impossible)]
    assert sorted(n for n, _ in refused) == honest, refused  # once per node: banned from then on
    assert all(e.peer_id == "x" and "two updates of round" in e.reason for _, e in refused)
    assert all(sim.machines[n].audit.banned == {"x"} for n in honest)
    assert len({sim.history[n][5] for n in honest}) == 1
    assert not [e for n, e in sim.events if n in honest and isinstance(e, Apply) and not e.chosen]
    late = {e.round for n, e in sim.events if n in honest and isinstance(e, Apply) for a in e.chosen
            if "x" in a.included}
    assert late <= {0}, late  # its first round's update may be in before its second version is heard


@pytest.mark.parametrize("seed", range(3))
def test_an_aggregator_signing_two_results_for_one_aggregate_is_banned_by_every_node_that_hears_both(seed):
    from protocol.task_machine import Impossible
    names = ["a", "b", "c", "d", "e"]
    liar = names[seed]
    sim = Swarm(names, rounds=6, slices=2, k=2, min_members=3, seed=seed)
    sim.equivocate[liar] = "result"  # half the nodes hear the forged version first, the rest the honest one
    honest = _honest(sim, {liar})
    sim.run_until(lambda: all(sim.machines[n].stage is Stage.DONE for n in honest), 300)
    assert all(sim.machines[n].audit.banned == {liar} for n in honest), [sim.machines[n].audit.banned for n in honest]
    assert all(e.peer_id == liar for n, e in sim.events if n in honest and isinstance(e, Impossible))
    assert not [(n, a) for n, a in _applied_results(sim, honest) if a.result_hash != _truth_of(sim, n, a)]
    assert all(len({sim.history[n].get(r) for n in honest}) == 1 for r in range(6))


def test_two_versions_of_an_aggregate_over_other_inputs_are_ranked_alike_by_every_node():
    names = ["a", "b", "c", "d", "e"]
    sim = Swarm(names, rounds=6, slices=2, k=2, min_members=3)
    sim.equivocate["e"] = "inputs"  # both versions honest computations, over different producers
    sim.run_until(sim.all_done, 300)
    assert not [e for n, e in sim.events if isinstance(e, Dissent)], "nodes applied different aggregates"
    assert all(not sim.machines[n].audit.banned for n in names)  # a restarted aggregator does the same
    assert sum(sim.machines[n].dropped["two_aggregates"] for n in names) > 0
    assert len(final_hashes(sim)) == 1
