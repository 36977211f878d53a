"""The per-task round state machine of one node: members, aggregators, closing rules, choices, majority.

Sans-IO: the caller feeds verified messages, liveness and its own progress with an explicit
``now`` and acts on the returned effects. Every choice is a pure function of the messages
seen, so honest nodes that saw the same messages decide the same; a node that decided
differently finds out through the weights majority and re-syncs.

Round r on one node: ``start_round`` (it holds θ_r) -> updates arrive -> collection closes
(all members published, or ``round_deadline_s`` after the start) -> the aggregators of each
slice aggregate -> aggregates arrive -> gathering closes (every expected aggregator answered,
or a second deadline) -> ``finish_round`` with the new weights hash -> weights announcements
arrive -> the majority closes (every member answered, or a third deadline).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from protocol.rendezvous import make_key, top
from protocol.task import AggregateAnnounce, TaskJoin, UpdateAnnounce, WeightsAnnounce

@lru_cache(maxsize=1024)
def _aggregators(task_id: str, r: int, slice_index: int, members: tuple[str, ...], k: int) -> tuple[str, ...]:
    """Pure, so memoized: simulated swarms in one process share the hashing."""
    return tuple(top(make_key("aggregate", task_id, r, slice_index), members, k))


KEEP_ROUNDS = 4
"""Rounds of messages kept beside the current one: older ones are late and dropped."""
AHEAD_ROUNDS = 2
"""Messages up to this many rounds ahead are buffered (a faster peer), further ones dropped."""


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Collection closed and this node is an aggregator of ``slice``: combine these updates."""

    round: int
    slice: int
    updates: tuple[UpdateAnnounce, ...]  # sorted by producer


@dataclass(frozen=True, slots=True)
class Apply:
    """Gathering closed: fetch these aggregates (one per slice, by slice) and apply the outer step."""

    round: int
    chosen: tuple[AggregateAnnounce, ...]


@dataclass(frozen=True, slots=True)
class RoundFailed:
    """Some slice got no aggregate in time: keep θ_r for round r + 1 (every node sees the same gap)."""

    round: int
    reason: str


@dataclass(frozen=True, slots=True)
class Agreed:
    round: int
    weights_hash: str
    num_agree: int
    num_disagree: int


@dataclass(frozen=True, slots=True)
class Resync:
    """This node's weights after ``round`` are not the majority's: fetch them from ``sources``."""

    round: int
    weights_hash: str
    state_hash: str
    sources: tuple[WeightsAnnounce, ...]


@dataclass(frozen=True, slots=True)
class Dissent:
    """A peer announced weights that differ from the majority (detected, not yet judged)."""

    round: int
    peer_id: str
    weights_hash: str


Effect = Aggregate | Apply | RoundFailed | Agreed | Resync | Dissent


@dataclass
class _Round:
    index: int
    started_at: float | None = None
    base_hash: str = ""
    producing: bool = False
    updates: dict[str, UpdateAnnounce] = field(default_factory=dict)
    aggregates: dict[int, dict[str, AggregateAnnounce]] = field(default_factory=dict)
    weights: dict[str, WeightsAnnounce] = field(default_factory=dict)
    members: tuple[str, ...] = ()
    aggregators: dict[int, tuple[str, ...]] = field(default_factory=dict)
    collected_at: float | None = None
    gathered: bool = False
    finished_at: float | None = None
    my_hash: str = ""
    majority_done: bool = False


@dataclass(kw_only=True)
class RoundMachine:
    task_id: str
    self_id: str
    num_slices: int
    aggregators_per_slice: int
    round_deadline_s: float
    max_samples: int
    max_members: int
    joins: dict[str, int] = field(default_factory=dict)
    alive: set[str] = field(default_factory=set)
    rounds: dict[int, _Round] = field(default_factory=dict)
    current: int = -1
    _members: dict[int, list[str]] = field(default_factory=dict)
    dropped: Counter = field(default_factory=Counter)

    # -- membership --------------------------------------------------------------------------

    def on_join(self, msg: TaskJoin) -> None:
        if msg.task_id == self.task_id:
            self._joined(msg.peer_id, msg.round)

    def _joined(self, peer: str, r: int) -> None:
        # The earliest round a peer claims wins: a rejoin never removes it from rounds it is in.
        # Updates and weights count as joins too, so a node that arrives late (and never saw the
        # members' TaskJoin messages) still learns who the members are.
        if r < self.joins.get(peer, r + 1):
            self.joins[peer] = r
            self._members.clear()

    def set_alive(self, peers: set[str], now: float) -> list[Effect]:
        """Peers the caller considers live (heartbeats); a dead member stops being waited for."""
        if peers != self.alive:
            self.alive = set(peers)
            self._members.clear()
        return self.tick(now)

    def members(self, r: int) -> list[str]:
        """Live peers that joined by round r (and this node once it produces), at most max_members."""
        cached = self._members.get(r)
        if cached is not None:
            return cached
        rec = self.rounds.get(r)
        out = {p for p, first in self.joins.items() if first <= r and (p in self.alive or p == self.self_id)}
        if rec is not None and rec.producing:
            out.add(self.self_id)
        self._members[r] = sorted(out)[: self.max_members]
        return self._members[r]

    def aggregators(self, r: int, slice_index: int, members: list[str] | tuple[str, ...]) -> list[str]:
        return list(_aggregators(self.task_id, r, slice_index, tuple(members), self.aggregators_per_slice))

    # -- this node's progress ------------------------------------------------------------------

    def _round(self, r: int) -> _Round | None:
        # Before its first round a node (a joiner) does not know where the swarm is: it keeps the
        # newest rounds it hears of; afterwards only a window around its own round.
        if self.current >= 0 and not self.current - KEEP_ROUNDS <= r <= self.current + AHEAD_ROUNDS:
            return None
        rec = self.rounds.get(r)
        if rec is None:
            rec = self.rounds[r] = _Round(index=r)
            while len(self.rounds) > KEEP_ROUNDS + AHEAD_ROUNDS + 1:
                oldest = min(self.rounds)
                if oldest == r:
                    del self.rounds[r]
                    return None
                del self.rounds[oldest]
        return rec

    def start_round(self, r: int, *, base_hash: str, producing: bool, now: float) -> list[Effect]:
        """This node holds θ_r (hash ``base_hash``); ``producing`` if it will publish an update."""
        assert r > self.current, "rounds only move forward"
        self.current = r
        for old in [i for i in self.rounds if i < r - KEEP_ROUNDS]:
            del self.rounds[old]
        rec = self._round(r)
        assert rec is not None
        rec.started_at, rec.base_hash, rec.producing = now, base_hash, producing
        if producing:
            self.joins.setdefault(self.self_id, r)
        self._members.clear()
        # Updates buffered before we knew the base are kept only if they start from it.
        for producer in [p for p, u in rec.updates.items() if u.base_hash != base_hash]:
            del rec.updates[producer]
            self.dropped["wrong_base"] += 1
        return self.tick(now)

    def finish_round(self, r: int, *, weights_hash: str, now: float) -> list[Effect]:
        """This node applied round r (or kept θ_r after a failure): its θ_{r+1} hash."""
        rec = self.rounds.get(r)
        assert rec is not None and rec.started_at is not None, "finish_round of a round never started"
        rec.finished_at, rec.my_hash = now, weights_hash
        return self.tick(now)

    # -- messages from peers -----------------------------------------------------------------

    def on_update(self, msg: UpdateAnnounce, now: float) -> list[Effect]:
        rec = self._round(msg.round) if msg.task_id == self.task_id else None
        if rec is None or rec.collected_at is not None:
            self.dropped["late_update"] += 1
            return []
        if len(msg.manifest_ids) != self.num_slices or msg.samples > self.max_samples:
            self.dropped["bad_update"] += 1
            return []
        if rec.started_at is not None and msg.base_hash != rec.base_hash:
            self.dropped["wrong_base"] += 1
            return []
        rec.updates.setdefault(msg.producer, msg)
        self._joined(msg.producer, msg.round)
        return self._check_collect(rec, now)

    def on_aggregate(self, msg: AggregateAnnounce, now: float) -> list[Effect]:
        rec = self._round(msg.round) if msg.task_id == self.task_id else None
        if rec is None or rec.gathered or not 0 <= msg.slice < self.num_slices:
            self.dropped["late_aggregate"] += 1
            return []
        rec.aggregates.setdefault(msg.slice, {}).setdefault(msg.aggregator, msg)
        return self._check_gather(rec, now)

    def on_weights(self, msg: WeightsAnnounce, now: float) -> list[Effect]:
        if msg.task_id != self.task_id:
            return []
        self._joined(msg.peer_id, msg.round + 1)
        rec = self._round(msg.round)
        if rec is None or rec.majority_done:
            self.dropped["late_weights"] += 1
            return []
        rec.weights[msg.peer_id] = msg
        return self._check_majority(rec, now)

    def tick(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for r in sorted(self.rounds):
            rec = self.rounds[r]
            effects += self._check_collect(rec, now)
            effects += self._check_gather(rec, now)
            effects += self._check_majority(rec, now)
        return effects

    def next_deadline(self) -> float | None:
        """When tick() next has something to decide by time alone (None: only messages will)."""
        times = []
        for rec in self.rounds.values():
            if rec.started_at is None:
                continue
            if rec.collected_at is None:
                times.append(rec.started_at + self.round_deadline_s)
            elif not rec.gathered:
                times.append(rec.collected_at + self.round_deadline_s)
            if rec.finished_at is not None and not rec.majority_done:
                times.append(rec.finished_at + self.round_deadline_s)
        return min(times, default=None)

    # -- closing rules -------------------------------------------------------------------------

    def _check_collect(self, rec: _Round, now: float) -> list[Effect]:
        if rec.started_at is None or rec.collected_at is not None:
            return []
        members = self.members(rec.index)
        # The length test first keeps a 1,000-member round linear in its messages.
        everyone = (len(rec.updates) >= len(members) and bool(rec.updates)
                    and all(p in rec.updates for p in members))
        if not everyone and now < rec.started_at + self.round_deadline_s:
            return []
        rec.collected_at = now
        rec.members = tuple(members)
        effects: list[Effect] = []
        updates = tuple(rec.updates[p] for p in sorted(rec.updates))
        for s in range(self.num_slices):
            rec.aggregators[s] = tuple(self.aggregators(rec.index, s, members))
            if self.self_id in rec.aggregators[s] and updates:
                effects.append(Aggregate(rec.index, s, updates))
        return effects + self._check_gather(rec, now)

    def _check_gather(self, rec: _Round, now: float) -> list[Effect]:
        if rec.collected_at is None or rec.gathered:
            return []
        live = {p for p in rec.members if p in self.alive or p == self.self_id}
        chosen, complete = [], True
        for s in range(self.num_slices):
            expected = rec.aggregators.get(s, ())
            got = {a: m for a, m in rec.aggregates.get(s, {}).items() if a in expected}
            if any(a in live and a not in got for a in expected) or not got:
                complete = False
            if got:
                # Most producers covered wins; equal coverage falls to the smaller hash, on every node.
                chosen.append(min(got.values(), key=lambda m: (-len(m.included), m.result_hash)))
        if not complete and now < rec.collected_at + self.round_deadline_s:
            return []
        rec.gathered = True
        if len(chosen) < self.num_slices:
            return [RoundFailed(rec.index, f"{self.num_slices - len(chosen)} slice(s) got no aggregate in time")]
        return [Apply(rec.index, tuple(chosen))]

    def _check_majority(self, rec: _Round, now: float) -> list[Effect]:
        if rec.finished_at is None or rec.majority_done:
            return []
        if now < rec.finished_at + self.round_deadline_s:
            # The length test first keeps a 1,000-member round linear in its messages.
            if len(rec.weights) < len(rec.members) - 1:
                return []
            if any(p not in rec.weights for p in rec.members if p != self.self_id and p in self.alive):
                return []
        voters = {p: w for p, w in rec.weights.items() if p != self.self_id}
        rec.majority_done = True
        votes = Counter(w.weights_hash for w in voters.values())
        votes[rec.my_hash] += 1
        winner = min(votes, key=lambda h: (-votes[h], h))
        effects: list[Effect] = [Dissent(rec.index, p, w.weights_hash)
                                 for p, w in sorted(voters.items()) if w.weights_hash != winner]
        if winner == rec.my_hash:
            effects.append(Agreed(rec.index, winner, votes[winner], sum(votes.values()) - votes[winner]))
        else:
            sources = tuple(w for _, w in sorted(voters.items()) if w.weights_hash == winner)
            state = Counter(w.state_hash for w in sources).most_common(1)[0][0]
            effects.append(Resync(rec.index, winner, state,
                                  tuple(w for w in sources if w.state_hash == state and w.state_manifest)))
        return effects

    # -- joining late ----------------------------------------------------------------------------

    def latest_majority(self) -> tuple[int, str, str, tuple[WeightsAnnounce, ...]] | None:
        """(round, weights hash, state hash, sources) of the newest round with announced weights."""
        for r in sorted(self.rounds, reverse=True):
            ws = self.rounds[r].weights
            if not ws:
                continue
            votes = Counter((w.weights_hash, w.state_hash) for w in ws.values())
            (wh, sh), _ = min(votes.items(), key=lambda kv: (-kv[1], kv[0]))
            return r, wh, sh, tuple(w for _, w in sorted(ws.items()) if (w.weights_hash, w.state_hash) == (wh, sh))
        return None

    def observe_round(self, r: int) -> None:
        """Follow round r's messages before holding θ_r (a joiner): buffer without a base."""
        self._round(r)

    def statistics(self) -> dict:
        rec = self.rounds.get(self.current)
        return {"round": self.current, "members": list(self.members(max(self.current, 0))),
                "updates": len(rec.updates) if rec else 0, "dropped": dict(self.dropped)}
