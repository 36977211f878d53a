"""An in-process swarm of task machines: one broadcast queue, instant work, a clock, partitions, deaths.

The machines decide everything; the sim only delivers messages (within a partition group), hears
heartbeats, and answers each effect at once with the event a node's executor would send.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
import random
from collections import deque

from protocol.audit import UNDECODABLE, Accused, Audit, FalseAccusation, Forged, Verified, Verify
from protocol.heard import HeardLog
from protocol.round import Head
from protocol.task import AggregateAnnounce, TaskJoin, UpdateAnnounce, WeightsAnnounce
from protocol.task_machine import (Aggregate, Aggregated, Applied, Apply, Dissent, FetchState, Finished,
                                   MakeInitial, PeerGone, Publish, RoundClosed, ScreenedOut, Stage, Synced, SyncFailed,
                                   TaskMachine, Train, Trained)

TASK = "ab" * 32
DEADLINE_S = 30.0
QUIET_S = 3.0
HEARTBEAT_S = 1.0
TRAIN_S = 2.0
TRAIN_SHARE = 0.5
"""What every simulated node reports as its training share with its weights."""
MAX_SAMPLES = 1000
ANNOUNCE_S = 4.0
"""Each node re-gossips its latest weights this often, as the runner does, so restarted nodes hear them."""


def h(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class BlindAudit(Audit):
    """A forger's: it never bans anyone (its own lies would make it ban the honest aggregators it contradicts)."""

    def judge(self, a, *, accuser=None) -> list:
        return []


def truth(r: int, slice_index: int, updates) -> str:
    """What aggregating these updates' slices gives: a deterministic function of the inputs, as on a node."""
    return h("agg", r, slice_index, tuple((u.producer, u.manifest_ids[slice_index]) for u in updates))


INIT = Head(round=0, weights_hash=h("init"), state_hash=h("init-state"), work=0)


class Swarm:
    def __init__(self, names, *, rounds=10, slices=2, k=2, min_members=1, listen_s=5.0, lie=(), sync_s=0.0, forge=(),
                 spot_check=0.0, seed=0):
        self.now = 0.0
        self.apply_s: dict[str, float] = {}
        self.aggregate_s: dict[str, float] = {}
        """Per node, simulated seconds its aggregation takes (fetching and combining); others aggregate at once."""
        """Per node, simulated seconds its Apply takes (a slow trainer); others apply at once."""
        self.sync_s = sync_s
        """Simulated seconds a weights fetch takes (0: at once); the swarm moves on meanwhile."""
        self.rounds, self.slices, self.k, self.min_members, self.listen_s = rounds, slices, k, min_members, listen_s
        self.queue: deque = deque()
        self.machines: dict[str, TaskMachine] = {}
        self.group: dict[str, int] = {}
        self.logs: dict[int, HeardLog] = {}
        self._groups: dict[int, list[tuple[str, TaskMachine]]] = {}
        """Per partition group, its heartbeats: written once, read by every machine in the group."""
        self.dead: set[str] = set()
        self.lie = set(lie)
        self.inflate: dict[str, int] = {}
        """Per node, work it adds to what its weights announcements claim (a lying or mistaken member)."""
        self.mute: set[str] = set()
        self.forge: set[str] = set(forge)
        """Aggregators whose aggregates do not match their inputs (a valid hash and signature over a wrong result,
        each its own lie), and which never check anyone's: their machines judge nothing."""
        self.screen: dict[str, str] = {}
        """Producers whose every slice the screen leaves out, and why (a free-rider's zeros, a sign flip)."""
        self.overclaim: set[str] = set()
        """Producers whose updates claim more samples than a round's inner steps draw (max_samples)."""
        self.equivocate: dict[str, str] = {}
        """Aggregators that also sign a second version of each aggregate, sent first to half of the others and a
        moment later to the rest: "result" (the same inputs, a forged result) or "inputs" (one producer fewer)."""
        self.two_updates: set[str] = set()
        """Producers that sign a second update of each round (other slices, the same base) and send each half of the
        others one version first, the other a moment later (as gossip relays it)."""
        self.omit: set[str] = set()
        """Aggregators that leave one other producer's update out of each aggregate without a word (so their
        aggregate never covers every update the others collected)."""
        self.collude: set[str] = set()
        """Aggregators that forge one shared lie and vouch for each other: each of their aggregates is also announced,
        the same, under every other live colluder's name (any member may announce an aggregate); they judge nothing."""
        self.frame: set[str] = set()
        """Aggregators that claim the screen left out an honest producer's slice (one the screen keeps)."""
        self.charged: list[tuple[str, ScreenedOut]] = []
        self.spot_check, self.seed = spot_check, seed
        self.forged: list[tuple[str, Forged]] = []
        self.false_accusations: list[tuple[str, FalseAccusation]] = []
        self.verifications = 0
        self.slow_links: dict[tuple[str, str, type], float] = {}
        """(sender, receiver, message type): simulated seconds such messages take to reach the receiver."""
        self.saved: dict[str, Head] = {}
        self.fail_fetches: dict[str, int] = {}
        """Per node, how many of its next weights fetches fail at once (a source that does not answer yet)."""
        self.history: dict[str, dict[int, str]] = {}
        self.closed: list[tuple[str, RoundClosed]] = []
        self.events: list[tuple[str, object]] = []
        self.states: set[tuple[str, str]] = {(INIT.weights_hash, INIT.state_hash)}
        self.next_heartbeat = 0.0
        self.next_announce = ANNOUNCE_S
        self.announced: dict = {}
        self.later: list = []  # (due, seq, name, event): training takes TRAIN_S of simulated time
        self._seq = itertools.count()
        for n in names:
            self.add(n)

    # -- nodes ---------------------------------------------------------------------------------

    def add(self, name: str, saved: Head | None = None) -> None:
        m = TaskMachine(task_id=TASK, self_id=name, rounds=self.rounds, num_slices=self.slices,
                        aggregators_per_slice=self.k, round_deadline_s=DEADLINE_S, quiet_after_s=QUIET_S,
                        listen_s=self.listen_s, min_members=self.min_members, max_members=100_000, max_samples=MAX_SAMPLES,
                        spot_check=self.spot_check, rng=random.Random(f"{self.seed}/{name}"))
        if name in self.forge or name in self.collude:
            m.audit = BlindAudit()
        self.machines[name] = m
        self.announced.pop(name, None)
        self.group.setdefault(name, 0)
        self.dead.discard(name)
        self._groups.clear()
        self.history.setdefault(name, {})
        m.share_heard(self._log(self.group[name]), self.now)
        self._heartbeat(only=name)
        self.handle(name, m.start(saved, self.now))

    def kill(self, name: str, *, sockets_close: bool = False) -> None:
        """``sockets_close``: every other node sees its connections to the victim close (PeerGone) at once."""
        self.dead.add(name)
        if sockets_close:
            for n in self.alive():
                self.local(n, PeerGone(peer_id=name))
        # Work the dead process had under way never finishes, even if it is restarted before it would have.
        self.later = [item for item in self.later if item[2] != name]
        heapq.heapify(self.later)
        self._groups.clear()

    def _in_group(self, group: int) -> list[tuple[str, TaskMachine]]:
        """The live machines of a group, in the order they were added: who a broadcast reaches."""
        found = self._groups.get(group)
        if found is None:
            found = self._groups[group] = [(n, m) for n, m in self.machines.items()
                                           if n not in self.dead and self.group[n] == group]
        return found

    def restart(self, name: str) -> None:
        self.add(name, self.saved.get(name))

    def split(self, *groups) -> None:
        for g, names in enumerate(groups):
            for n in names:
                self.group[n] = g
        self._groups.clear()
        self._new_logs()

    def heal(self) -> None:
        for n in self.group:
            self.group[n] = 0
        self._groups.clear()
        self._new_logs()

    def _log(self, group: int) -> HeardLog:
        if group not in self.logs:
            self.logs[group] = HeardLog(QUIET_S)
        return self.logs[group]

    def _new_logs(self) -> None:
        """Each group hears only its own from now on; what a machine heard before stays heard."""
        self.logs = {}
        for n in self.alive():
            self.machines[n].share_heard(self._log(self.group[n]), self.now)

    def alive(self):
        return [n for n in self.machines if n not in self.dead]

    # -- the wire and the executor ---------------------------------------------------------------

    def broadcast(self, sender, msg) -> None:
        self.queue.append(("msg", sender, msg, self.group[sender], None))

    def handle(self, name: str, effects) -> None:
        for e in effects:
            self.events.append((name, e))
            if isinstance(e, Publish) and isinstance(e.message, WeightsAnnounce) and name in self.inflate:
                e = Publish(dataclasses.replace(e.message, work=e.message.work + self.inflate[name]))
            if isinstance(e, Publish) and isinstance(e.message, UpdateAnnounce) and name in self.two_updates:
                self._two_updates(name, e.message)
            elif isinstance(e, Publish):
                self.broadcast(name, e.message)
                if isinstance(e.message, WeightsAnnounce):
                    self.announced[name] = e.message
            elif isinstance(e, Train):
                ids = tuple(h(name, e.round, s, e.base_hash) for s in range(self.slices))
                heapq.heappush(self.later, (self.now + TRAIN_S, next(self._seq), name,
                                            Trained(round=e.round, samples=MAX_SAMPLES + 1 if name in self.overclaim
                                                    else 10, manifest_ids=ids, losses=(1.0,))))
            elif isinstance(e, Aggregate) and name not in self.mute:
                if self.aggregate_s.get(name):
                    # Its fetches take that long: producers dead by their end are left out.
                    heapq.heappush(self.later, (self.now + self.aggregate_s[name], next(self._seq), name, e))
                else:
                    self._aggregate(name, e)
            elif isinstance(e, Verify):
                self.verifications += 1
                claimed = {i.producer: why for i, why in e.screened}
                bears_out = {p: self.screen[p] for p in (*(i.producer for i in e.inputs), *claimed) if p in self.screen}
                result = h("agg", e.round, e.slice, tuple((i.producer, i.manifest_id) for i in e.inputs)) \
                    if claimed == bears_out else UNDECODABLE
                self.local(name, Verified(key=e.key, result_hash=result))
            elif isinstance(e, ScreenedOut):
                self.charged.append((name, e))
            elif isinstance(e, Forged):
                self.forged.append((name, e))
                if e.prove:
                    self.broadcast(name, Accused(aggregate=e.aggregate, accuser=name))
            elif isinstance(e, FalseAccusation):
                self.false_accusations.append((name, e))
            elif isinstance(e, Apply):
                base = self.machines[name].head
                new = h(base.weights_hash, tuple(a.result_hash for a in e.chosen)) if e.chosen else base.weights_hash
                if name in self.lie:
                    new = h("lie", new)
                state = h("state", new)
                self.states.add((new, state))
                self.history[name][e.round] = new
                applied = Applied(round=e.round, weights_hash=new, state_hash=state, state_manifest=h("m", new),
                                  eval_loss=1.0, train_share=TRAIN_SHARE)
                if self.apply_s.get(name):
                    heapq.heappush(self.later, (self.now + self.apply_s[name], next(self._seq), name, applied))
                else:
                    self.local(name, applied)
            elif isinstance(e, FetchState):
                reachable = [s for s in e.sources if s.peer_id not in self.dead
                             and self.group[s.peer_id] == self.group[name]]
                if self.fail_fetches.get(name):
                    self.fail_fetches[name] -= 1
                    reachable = []
                if reachable and (e.head.weights_hash, e.head.state_hash) in self.states and self.sync_s:
                    heapq.heappush(self.later, (self.now + self.sync_s, next(self._seq), name, Synced(head=e.head)))
                elif reachable and (e.head.weights_hash, e.head.state_hash) in self.states:
                    self.local(name, Synced(head=e.head))
                else:
                    self.local(name, SyncFailed(head=e.head, reason="no source"))
            elif isinstance(e, MakeInitial):
                self.local(name, Synced(head=INIT))
            elif isinstance(e, RoundClosed):
                self.closed.append((name, e))
                self.history[name][e.round] = e.weights_hash
        m = self.machines[name]
        if m.head is not None and m.stage is not Stage.SYNCING:
            self.saved[name] = m.head  # what the node's checkpoint holds

    def _aggregate(self, name: str, e: Aggregate) -> None:
        left = {u.producer: self.screen[u.producer] for u in e.updates if u.producer in self.screen}
        if name in self.frame:
            victim = next((u.producer for u in e.updates if u.producer not in left and u.producer != name), None)
            if victim is not None:
                left[victim] = "opposed"
        # A dead producer serves its slices to nobody: the aggregator's fetch of them gives up.
        kept = [u for u in e.updates if u.producer not in left and u.producer not in self.dead]
        if name in self.omit and len(kept) > 1:
            kept = [u for u in kept if u.producer != name][1:] + [u for u in kept if u.producer == name]
        if not kept:
            return  # every slice screened out: no aggregate, as on a node
        out = sorted((u for u in e.updates if u.producer in left), key=lambda u: u.producer)
        result = truth(e.round, e.slice, kept)
        if name in self.forge:
            result = h("forged", name, result)
        if name in self.collude:
            result = h("forged", "collusion", result)
        if name in self.equivocate:
            self._equivocate(name, e, kept, result)
        made = Aggregated(round=e.round, slice=e.slice, included=tuple(u.producer for u in kept),
                          inputs=tuple(u.manifest_ids[e.slice] for u in kept),
                          manifest_id=result, result_hash=result,
                          screened=tuple(u.producer for u in out),
                          screened_inputs=tuple(u.manifest_ids[e.slice] for u in out),
                          screened_why=tuple(left[u.producer] for u in out))
        if name in self.collude:
            self._vouch(name, made)
        self.local(name, made)

    def _two_updates(self, name: str, msg: UpdateAnnounce) -> None:
        other = dataclasses.replace(msg, manifest_ids=tuple(h("other", m) for m in msg.manifest_ids))
        peers = [n for n in self.alive() if n != name]
        first, rest = peers[: len(peers) // 2], peers[len(peers) // 2:]
        self.queue.append(("msg", name, msg, self.group[name], first))
        self.queue.append(("msg", name, other, self.group[name], rest))
        for n in rest:
            heapq.heappush(self.later, (self.now + 0.5, next(self._seq), n, msg))
        for n in first:
            heapq.heappush(self.later, (self.now + 0.5, next(self._seq), n, other))

    def _vouch(self, name: str, made: Aggregated) -> None:
        for other in sorted(self.collude - {name} - self.dead):
            if other in self.machines:
                fields = {f.name: getattr(made, f.name) for f in dataclasses.fields(Aggregated) if f.name != "round"}
                self.broadcast(other, AggregateAnnounce(task_id=TASK, round=made.round, aggregator=other, **fields))

    def forged_applied(self, names) -> int:
        """Aggregates that ``names`` applied whose result is not what their inputs give."""
        return sum(a.result_hash != h("agg", a.round, a.slice, tuple(zip(a.included, a.inputs)))
                   for n, e in self.events if n in names and isinstance(e, Apply) for a in e.chosen)

    def _equivocate(self, name: str, e: Aggregate, kept: list, result: str) -> None:
        how = self.equivocate[name]
        other = kept[1:] if how == "inputs" and len(kept) > 1 else kept
        forged = h("equivocated", name, result) if how == "result" else truth(e.round, e.slice, other)
        msg = AggregateAnnounce(task_id=TASK, round=e.round, slice=e.slice, aggregator=name,
                                included=tuple(u.producer for u in other),
                                inputs=tuple(u.manifest_ids[e.slice] for u in other), manifest_id=forged,
                                result_hash=forged)
        peers = [n for n in self.alive() if n != name]
        first, rest = peers[: len(peers) // 2], peers[len(peers) // 2:]
        self.queue.append(("msg", name, msg, self.group[name], first))
        for n in rest:
            heapq.heappush(self.later, (self.now + 0.5, next(self._seq), n, msg))

    def local(self, name, event) -> None:
        self.queue.append(("local", name, event, None, None))

    def run(self, max_steps=50_000_000) -> None:
        steps = 0
        while self.queue and steps < max_steps:
            kind, who, item, group, only = self.queue.popleft()
            steps += 1
            if who in self.dead:
                continue
            if kind == "local":
                self.handle(who, self.machines[who].handle(item, self.now))
                if isinstance(item, Synced):
                    self.history[who][item.head.round - 1] = item.head.weights_hash
                continue
            if only is None:
                for n, m in self._in_group(group):
                    if n != who:
                        self._deliver(who, n, m, item)
                continue
            for n in only:
                if n != who and n not in self.dead and self.group[n] == group:
                    self._deliver(who, n, self.machines[n], item)

    def _deliver(self, sender: str, name: str, m: TaskMachine, item) -> None:
        delay = self.slow_links.get((sender, name, type(item)))
        if delay is not None:
            heapq.heappush(self.later, (self.now + delay, next(self._seq), name, item))
            return
        effects = m.handle(item, self.now)
        if effects:
            self.handle(name, effects)

    def _heartbeat(self, only: str | None = None) -> None:
        alive = self.alive()
        if only:
            g = self.group[only]
            heard = {p: self.now for p in alive if self.group[p] == g and p != only}
            self.handle(only, self.machines[only].set_heard(heard, self.now))
            return
        for p in alive:
            self._log(self.group[p]).hear(p, self.now)
        for n in alive:
            self.handle(n, self.machines[n].heard_again(self.now))

    def advance(self, seconds: float) -> None:
        """Move the clock, waking machines at their deadlines and hearing heartbeats every HEARTBEAT_S."""
        until = self.now + seconds
        spins = 0
        while True:
            self.run()
            spins += 1
            if spins > 100_000:
                stuck = {n: (m.stage.value, m.current, m.next_deadline()) for n, m in self.machines.items()
                         if n not in self.dead and (m.next_deadline() or until + 1) <= self.now}
                raise AssertionError(f"a machine's deadline passed and tick() did not move it: {stuck}")
            deadlines = [d for n in self.alive() if (d := self.machines[n].next_deadline()) is not None]
            nxt = min([self.next_heartbeat, self.next_announce, *deadlines, *(self.later[:1] and [self.later[0][0]])])
            if nxt > until:
                break
            if nxt > self.now:
                spins = 0
            self.now = max(self.now, nxt)
            while self.later and self.later[0][0] <= self.now:
                _, _, name, event = heapq.heappop(self.later)
                if isinstance(event, Aggregate):
                    if name not in self.dead:
                        self._aggregate(name, event)
                else:
                    self.local(name, event)
            self.run()
            if self.now >= self.next_heartbeat:
                self.next_heartbeat = self.now + HEARTBEAT_S
                self._heartbeat()
            if self.now >= self.next_announce:
                self.next_announce = self.now + ANNOUNCE_S
                # A running machine returns at once on a re-announcement it has already seen, so those
                # are not handed to it: the same decisions, far fewer calls.
                alive = self.alive()
                for n in alive:
                    msg = self.announced.get(n)
                    if msg is None:
                        continue
                    to = [p for p in alive if (m := self.machines[p]).stage is not Stage.RUNNING
                          or ((seen := m.latest.get(n)) is not msg and seen != msg)]
                    if to:
                        self.queue.append(("msg", n, msg, self.group[n], to))
            for n in self.alive():
                d = self.machines[n].next_deadline()
                if d is not None and d <= self.now:
                    self.handle(n, self.machines[n].tick(self.now))
        self.now = until
        self.run()

    # -- checks ----------------------------------------------------------------------------------

    def rounds_done(self, name: str) -> int:
        m = self.machines[name]
        return m.head.round if m.head else 0

    def all_done(self) -> bool:
        """Every live honest node finished (a forger, banned everywhere, may never finish)."""
        return all(self.machines[n].stage is Stage.DONE for n in self.alive() if n not in self.forge)

    def run_until(self, predicate, limit_s: float, step_s: float = 1.0) -> float:
        start = self.now
        while not predicate():
            if self.now - start > limit_s:
                raise AssertionError(f"not reached within {limit_s} s; stages "
                                     f"{ {n: (m.stage.value, m.head.round if m.head else None, m.detail) for n, m in list(self.machines.items())[:6]} }")
            self.advance(step_s)
        return self.now - start

    def ledger_disagreements(self) -> dict[tuple[int, str], set]:
        """Rounds (with the weights they agreed on) where honest nodes credited different producers, slices
        or samples: every node that agreed on a round's weights must write the same receipts for it."""
        by_round: dict[tuple[int, str], set] = {}
        for n, e in self.closed:
            if n not in self.forge and e.credits is not None:
                by_round.setdefault((e.round, e.weights_hash), set()).add(e.credits)
        return {k: v for k, v in by_round.items() if len(v) > 1}

    def disagreements(self) -> dict[int, set[str]]:
        """Rounds where honest nodes (all but the forgers) recorded different weights hashes.

        With forgers in the swarm, only the rounds each node closed count: a newcomer may first sync to
        the forgers' history (it cannot know they are banned) before it hears the members' and moves."""
        if self.forge:
            by_round: dict[int, set[str]] = {}
            for n, e in self.closed:
                if n not in self.forge:
                    by_round.setdefault(e.round, set()).add(e.weights_hash)
            return {r: s for r, s in by_round.items() if len(s) > 1}
        by_round = {}
        for n, hist in self.history.items():
            for r, wh in hist.items():
                by_round.setdefault(r, set()).add(wh)
        return {r: s for r, s in by_round.items() if len(s) > 1}

    def dissents(self):
        return [(n, e) for n, e in self.events if isinstance(e, Dissent)]

    def finished(self):
        return [(n, e) for n, e in self.events if isinstance(e, Finished)]

    def join_msgs(self, name):
        return [e.message for n, e in self.events
                if n == name and isinstance(e, Publish) and isinstance(e.message, TaskJoin)]
