"""Round state machines talking over a simulated wire: agreement, dead members, late joiners, dissent, scale."""

from __future__ import annotations

import hashlib
from collections import deque

import pytest

from protocol.round import Agreed, Aggregate, Apply, Dissent, Resync, RoundFailed, RoundMachine
from protocol.task import AggregateAnnounce, TaskJoin, UpdateAnnounce, WeightsAnnounce

TASK = "ab" * 32
DEADLINE_S = 10.0


def h(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class Sim:
    """N nodes, one broadcast queue, instant aggregation: the machines decide, the sim only delivers."""

    def __init__(self, names, *, slices=2, k=2, lie=(), joins_at=None):
        self.now = 0.0
        self.slices = slices
        self.queue: deque = deque()
        self.lie = set(lie)
        self.dead: set[str] = set()
        self.mute: set[str] = set()
        self.names = list(names)
        self.machines = {n: self._machine(n, slices, k) for n in self.names}
        self.weights = {n: h("init") for n in self.names}
        self.history: dict[str, list[tuple[int, str]]] = {n: [] for n in self.names}
        self.events: list[tuple[str, object]] = []
        joins_at = joins_at or {}
        for n in self.names:
            for m in self.machines.values():
                m.on_join(TaskJoin(task_id=TASK, peer_id=n, round=joins_at.get(n, 0)))
        for m in self.machines.values():
            m.set_alive(set(self.names), self.now)

    def _machine(self, name, slices, k):
        return RoundMachine(task_id=TASK, self_id=name, num_slices=slices, aggregators_per_slice=k,
                            round_deadline_s=DEADLINE_S, max_samples=1000, max_members=100_000)

    def start(self, name, r, producing=True):
        self.handle(name, self.machines[name].start_round(r, base_hash=self.weights[name], producing=producing,
                                                            now=self.now))
        if producing:
            ids = tuple(h(name, r, s) for s in range(self.slices))
            self.broadcast(name, UpdateAnnounce(task_id=TASK, round=r, producer=name, base_hash=self.weights[name],
                                                samples=10, manifest_ids=ids, losses=(1.0,)))

    def broadcast(self, sender, msg):
        self.queue.append((sender, msg))

    def kill(self, name):
        self.dead.add(name)
        for n, m in self.machines.items():
            if n not in self.dead:
                self.handle(n, m.set_alive(set(self.names) - self.dead, self.now))

    def handle(self, name, effects):
        for e in effects:
            self.events.append((name, e))
            if isinstance(e, Aggregate) and name not in self.mute:
                included = tuple(u.producer for u in e.updates)
                result = h("agg", e.round, e.slice, tuple((u.producer, u.manifest_ids[e.slice]) for u in e.updates))
                self.broadcast(name, AggregateAnnounce(task_id=TASK, round=e.round, slice=e.slice, aggregator=name,
                                                       included=included, manifest_id=result, result_hash=result))
            elif isinstance(e, (Apply, RoundFailed)):
                chosen = tuple(a.result_hash for a in e.chosen) if isinstance(e, Apply) else ("failed",)
                new = h(self.weights[name], chosen)
                if name in self.lie:
                    new = h("lie", new)
                self.weights[name] = new
                self.history[name].append((e.round, new))
                self.handle(name, self.machines[name].finish_round(e.round, weights_hash=new, now=self.now))
                self.broadcast(name, WeightsAnnounce(task_id=TASK, round=e.round, peer_id=name, weights_hash=new,
                                                     state_hash=new, state_manifest=h("state", name, new),
                                                     eval_loss=1.0))
            elif isinstance(e, Resync):
                self.weights[name] = e.weights_hash
                self.history[name][-1] = (e.round, e.weights_hash)

    def run(self, *, until_quiet=True, max_steps=10_000_000):
        steps = 0
        while self.queue and steps < max_steps:
            sender, msg = self.queue.popleft()
            if sender in self.dead:
                continue
            on = {UpdateAnnounce: RoundMachine.on_update, AggregateAnnounce: RoundMachine.on_aggregate,
                  WeightsAnnounce: RoundMachine.on_weights}[type(msg)]
            for n, m in self.machines.items():
                if n in self.dead:
                    continue  # the sender hears its own messages too, as the service feeds them back
                effects = on(m, msg, self.now)
                if effects:
                    self.handle(n, effects)
            steps += 1

    def advance(self, seconds):
        self.now += seconds
        for n, m in self.machines.items():
            if n not in self.dead:
                self.handle(n, m.tick(self.now))
        self.run()

    def done(self, name, r):
        return any(isinstance(e, (Agreed, Resync)) and e.round == r for n, e in self.events if n == name)


def play_rounds(sim, rounds, names=None):
    names = names or sim.names
    for r in range(rounds):
        for n in names:
            if n not in sim.dead:
                sim.start(n, r)
        sim.run()
        for _ in range(4):
            if all(sim.done(n, r) for n in names if n not in sim.dead):
                break
            sim.advance(DEADLINE_S)


def test_three_nodes_agree_every_round_without_waiting_for_deadlines():
    sim = Sim(["a", "b", "c"])
    play_rounds(sim, 3)
    assert sim.now == 0.0, "no deadline was needed"
    for r in range(3):
        assert len({dict(sim.history[n])[r] for n in "abc"}) == 1
    applied = [e for _, e in sim.events if isinstance(e, Apply)]
    assert all(len(a.included) == 3 for e in applied for a in e.chosen)
    aggs = [(n, e.slice) for n, e in sim.events if isinstance(e, Aggregate) and e.round == 0]
    assert len(aggs) == 2 * 2, "k=2 aggregators for each of 2 slices"


def test_two_nodes():
    sim = Sim(["a", "b"], slices=3, k=1)
    play_rounds(sim, 2)
    assert sim.history["a"] == sim.history["b"]


def test_member_dying_mid_round_costs_its_contribution_not_a_hang():
    sim = Sim(["a", "b", "c", "d"])
    for n in "abc":
        sim.start(n, 0)
    sim.kill("d")  # never published
    sim.run()
    assert all(sim.done(n, 0) for n in "abc")
    assert len({sim.weights[n] for n in "abc"}) == 1
    applied = [e for n, e in sim.events if isinstance(e, Apply)]
    assert all(a.included == ("a", "b", "c") for e in applied for a in e.chosen)


def test_silent_member_is_waited_for_until_the_deadline():
    sim = Sim(["a", "b", "c"])
    sim.start("a", 0)
    sim.start("b", 0)
    sim.run()
    assert not sim.done("a", 0)
    sim.dead.add("c")  # vanished without the liveness view noticing
    for _ in range(3):  # collection, gathering (c may be an aggregator), majority: one deadline each
        sim.advance(DEADLINE_S)
    assert sim.done("a", 0) and sim.done("b", 0)
    assert sim.weights["a"] == sim.weights["b"]


def test_late_update_is_dropped():
    sim = Sim(["a", "b", "c"])
    sim.start("a", 0)
    sim.start("b", 0)
    sim.run()
    sim.advance(DEADLINE_S)  # collection closes without c
    sim.start("c", 0)
    sim.run()
    assert any(m.dropped["late_update"] for n, m in sim.machines.items() if n != "c")
    aggregated = [e for n, e in sim.events if isinstance(e, Aggregate) and n in "ab"]
    assert aggregated and all("c" not in {u.producer for u in e.updates} for e in aggregated)
    for _ in range(3):
        sim.advance(DEADLINE_S)
    assert len({sim.weights[n] for n in "abc"}) == 1


def test_late_joiner_takes_part_from_its_round():
    sim = Sim(["a", "b", "c"], joins_at={"c": 2})
    play_rounds(sim, 2, names=["a", "b"])
    sim.weights["c"] = sim.weights["a"]  # fetched θ_2 from the majority
    play_rounds_from = 2
    for n in "abc":
        sim.start(n, play_rounds_from)
    sim.run()
    assert all(sim.done(n, 2) for n in "abc")
    assert len({sim.weights[n] for n in "abc"}) == 1
    applied = [e for n, e in sim.events if isinstance(e, Apply) and e.round == 2]
    assert all(a.included == ("a", "b", "c") for e in applied for a in e.chosen)


def test_node_with_different_weights_is_detected_and_resyncs():
    sim = Sim(["a", "b", "c"], lie={"c"})
    play_rounds(sim, 1)
    dissent = [e for n, e in sim.events if isinstance(e, Dissent)]
    assert {e.peer_id for e in dissent} == {"c"}
    resync = [(n, e) for n, e in sim.events if isinstance(e, Resync)]
    assert [n for n, _ in resync] == ["c"]
    _, e = resync[0]
    assert e.weights_hash == sim.weights["a"] and {s.peer_id for s in e.sources} == {"a", "b"}
    assert len({sim.weights[n] for n in "abc"}) == 1


def test_update_from_another_base_is_not_aggregated():
    sim = Sim(["a", "b", "c"])
    sim.weights["c"] = h("stale")
    play_rounds(sim, 1)
    applied = [e for n, e in sim.events if isinstance(e, Apply) and n == "a"]
    assert all("c" not in a.included for e in applied for a in e.chosen)
    assert sim.machines["a"].dropped["wrong_base"] >= 1


def test_all_aggregators_of_a_slice_dead_fails_the_round_on_every_node():
    sim = Sim(["a", "b", "c", "d"], slices=1, k=1)
    agg = sim.machines["a"].aggregators(0, 0, sim.names)[0]
    sim.mute.add(agg)  # crashes the moment it should aggregate
    for n in sim.names:
        sim.start(n, 0)
    sim.run()
    sim.kill(agg)
    for _ in range(3):
        sim.advance(DEADLINE_S)
    failed = {n for n, e in sim.events if isinstance(e, RoundFailed)}
    assert failed == set(sim.names) - {agg}
    assert len({sim.weights[n] for n in failed}) == 1
    assert all(sim.done(n, 0) for n in failed)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_thousand_nodes_agree():
    names = [f"node-{i:04d}" for i in range(1000)]
    sim = Sim(names, slices=4, k=2)
    play_rounds(sim, 1)
    assert sim.now == 0.0
    assert len({sim.weights[n] for n in names}) == 1
    aggregators = {n for n, e in sim.events if isinstance(e, Aggregate)}
    assert 1 <= len(aggregators) <= 8
    applied = [e for _, e in sim.events if isinstance(e, Apply)]
    assert len(applied) == 1000 and all(len(a.included) == 1000 for e in applied for a in e.chosen)
