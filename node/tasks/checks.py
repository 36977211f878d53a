"""Training checks: each round, every contributor's update is checked by one other contributor, chosen by
rendezvous (protocol.rendezvous.checker), for whether it trained on its own data (node/tasks/training_check.py).

The checker fetches the whole update, applies it to the round's weights and measures the loss on the first
batches its producer drew. An update that makes them worse by more than the threshold did not train on them
(a replayed or copied update, or one made up): the checker charges its producer and gossips a TrainingProof
that carries the producer's own sealed announcement. Every node that holds the round's weights measures it
again and charges the producer too, or, when its own measure clears the update, charges the accuser.
A second finding against one producer bans it (protocol/scores.py ``untrained_again``), which
drops its updates on every honest node alike, since every one of them measured the same.

What is checked: tiny-lm tasks whose members train a whole round from its weights (no ``overlap``: steps
carried from the last round trained on other batches) and updates of at least training_check.CHECK_MIN_STEPS inner steps.
An update whose shards are not the ones this node's view of the round assigns its producer, or whose base is
not the round's weights here, is not judged: nobody is charged on a guess.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from node.tasks import compute, training_check
from node.train.data import derive_seed, split_ranges
from node.train.diloco import Named
from protocol.envelope import open_sealed
from protocol.errors import RemoteProtocolError, TransportError
from protocol.rendezvous import assign_shards, checker
from protocol.task import TaskSpec, TrainingProof, UpdateAnnounce

log = logging.getLogger("shoal.tasks")

KEEP_ROUNDS = 2
"""Rounds whose weights and sealed updates are kept for checks: the last applied and the one before, for a
proof that arrives as the next round is applied."""
MAX_FINDINGS = 32
"""Untrained updates remembered for operators (``shoal task show``)."""
MAX_CHECKS_PER_ROUND = 64
"""Checks one node runs for one round at most (its own share is about one): proofs beyond are not followed."""


class TrainingChecks:
    def __init__(self, *, spec: TaskSpec, task_id: str, me: str, fetch_update: Callable[[UpdateAnnounce], Awaitable],
                 penalize: Callable[[str, str], None], publish: Callable[[object], Awaitable[None]],
                 corpus: Callable[[], Path | None], enabled: bool, max_bytes: int):
        self.spec, self.tid, self.me = spec, task_id, me
        self.fetch_update, self.penalize, self.publish, self.corpus = fetch_update, penalize, publish, corpus
        self.enabled = enabled and spec.overlap == 0 and training_check.judged(spec.inner_steps)
        self.max_bytes = max_bytes
        self.model = compute.model_config(spec) if self.enabled else None
        self.counts: Counter[str] = Counter()
        """Checks by outcome: passed, untrained (found here), confirmed, refuted (a peer's proof), unjudged."""
        self.seconds = 0.0
        """Time spent measuring (fetching not included): the verification compute."""
        self.findings: list[dict] = []
        self.strikes: Counter[str] = Counter()
        """Untrained updates found or confirmed here, per producer, this task."""
        self._bases: OrderedDict[int, compute.OuterState] = OrderedDict()
        self._members: OrderedDict[int, list[str]] = OrderedDict()
        self._sealed: OrderedDict[tuple[int, str], tuple[UpdateAnnounce, bytes]] = OrderedDict()
        self._gains: dict[tuple[int, str], float | None] = {}
        """Per (round, producer), the gain measured here (None: not judged), so a proof is measured once."""
        self._proof_bytes: dict[tuple[int, str], bytes] = {}
        """The sealed update of each measured one, until an accusation takes it."""
        self._running: dict[tuple[int, str], trio.Event] = {}
        self._per_round: Counter[int] = Counter()
        self._pending: dict[int, dict[str, str]] = {}
        """Per round not applied here yet, the proofs that arrived early: producer -> accuser."""

    # -- what the runner tells it ----------------------------------------------------------------

    def heard(self, msg: UpdateAnnounce, sealed: bytes) -> None:
        """An update announced on the task topic, as its producer sealed it (the proof carries these bytes)."""
        if self.enabled and msg.shards:
            self._sealed[(msg.round, msg.producer)] = (msg, sealed)
            while len(self._sealed) > (KEEP_ROUNDS + 2) * self.spec.max_members:
                self._sealed.popitem(last=False)

    def trained(self, round_: int, members: list[str]) -> None:
        """The members this node's view of round ``round_`` held when it trained (the shard assignment's)."""
        if self.enabled:
            self._members[round_] = list(members)
            _trim(self._members)

    def applied(self, round_: int, base: compute.OuterState, contributors: list[str], nursery: trio.Nursery,
                copies: list[str] = ()) -> None:
        """Round ``round_`` was applied from ``base`` (θ_r) with these contributors: check those this node is
        the checker of. ``copies``: producers the screen left out as near copies of each other, checked too
        (drawn among the contributors alike): the copy did not train on its own batches, the original did."""
        if not self.enabled or round_ not in self._members:
            return
        self._bases[round_] = base
        _trim(self._bases)
        oldest = round_ - KEEP_ROUNDS + 1
        for table in (self._gains, self._sealed, self._proof_bytes):
            for old in [k for k in table if k[0] < oldest]:
                del table[old]
        for table in (self._per_round, self._pending):
            for old in [r for r in table if r < oldest]:
                del table[old]
        for producer, accuser in self._pending.pop(round_, {}).items():
            nursery.start_soon(self._check, round_, producer, accuser)
        if self.me not in contributors:
            return  # a member that did not contribute holds no vote on others' work this round
        for producer in sorted({*contributors, *copies}):
            if producer != self.me and checker(self.tid, round_, producer, contributors) == self.me:
                nursery.start_soon(self._check, round_, producer, None)

    def proof(self, proof: TrainingProof, origin: str, nursery: trio.Nursery) -> None:
        """A peer's TrainingProof: measured again here, unless it is malformed or about this node."""
        try:
            inner = open_sealed(proof.update, max_bytes=self.max_bytes, expect=UpdateAnnounce)
        except RemoteProtocolError:
            self.penalize(origin, "malformed")
            return
        msg = inner.message
        if inner.signer != msg.producer or msg.task_id != self.tid:
            self.penalize(origin, "impersonation")
            return
        if not self.enabled or msg.producer == self.me:
            return
        self._sealed.setdefault((msg.round, msg.producer), (msg, proof.update))
        if msg.round in self._bases:
            nursery.start_soon(self._check, msg.round, msg.producer, proof.accuser)
        elif self._members and max(self._members) <= msg.round <= max(self._members) + 1 and \
                len(self._pending.get(msg.round, ())) < MAX_CHECKS_PER_ROUND:
            # A proof about the round this node is still closing: measured once it is applied here.
            self._pending.setdefault(msg.round, {}).setdefault(msg.producer, proof.accuser)

    def status(self) -> dict:
        return {"enabled": self.enabled, **{k: self.counts[k] for k in
                                            ("passed", "untrained", "confirmed", "refuted", "unjudged")},
                "seconds": round(self.seconds, 3), "findings": list(self.findings)}

    # -- the check -------------------------------------------------------------------------------

    async def _check(self, round_: int, producer: str, accuser: str | None) -> None:
        key = (round_, producer)
        if key not in self._gains:
            running = self._running.get(key)
            if running is not None:
                await running.wait()
            elif self._per_round[round_] >= MAX_CHECKS_PER_ROUND:
                return
            else:
                self._per_round[round_] += 1
                self._running[key] = trio.Event()
                try:
                    self._gains[key] = await self._measure(round_, producer)
                finally:
                    self._running.pop(key).set()
        gain = self._gains.get(key)
        if gain is None:
            self.counts["unjudged"] += 1
            return
        if accuser is None:
            if not training_check.untrained(gain):
                self.counts["passed"] += 1
                return
            self.counts["untrained"] += 1
            self._found(round_, producer, gain, by=self.me)
            sealed = self._proof_bytes.pop(key, None)
            if sealed is not None:
                await self.publish(TrainingProof(task_id=self.tid, accuser=self.me, update=sealed, gain=gain))
        elif training_check.confirms(gain):
            self.counts["confirmed"] += 1
            self._found(round_, producer, gain, by=accuser)
        else:
            self.counts["refuted"] += 1
            log.warning("task %s round %d: %s says %s's update did not train on its data; measured here it lowers "
                        "their loss by %.4f", self.tid[:12], round_, accuser, producer, gain)
            self.penalize(accuser, "false_accusation")

    def _found(self, round_: int, producer: str, gain: float, *, by: str) -> None:
        log.warning("task %s round %d: %s's update raises the loss on its own batches by %.4f: it did not train "
                    "on them (found by %s)", self.tid[:12], round_, producer, -gain, "this node" if by == self.me else by)
        self.findings = (self.findings + [{"round": round_, "producer": producer, "gain": round(gain, 4),
                                           "found_by": by}])[-MAX_FINDINGS:]
        # However long its rounds, a producer found twice in one task is banned: the second finding's charge
        # alone reaches the ban.
        self.strikes[producer] += 1
        self.penalize(producer, "untrained_update" if self.strikes[producer] == 1 else "untrained_again")

    async def _measure(self, round_: int, producer: str) -> float | None:
        """The gain of ``producer``'s update of ``round_`` on its own batches; None when it cannot be judged."""
        got = self._sealed.get((round_, producer))
        base, members, corpus = self._bases.get(round_), self._members.get(round_), self.corpus()
        if got is None or base is None or members is None or corpus is None:
            return None
        update, sealed = got
        steps = update.samples // self.spec.batch_size
        order = shards_of(self.tid, round_, producer, members, self.spec.dataset.num_shards)
        if not training_check.judged(steps) or sorted(order) != list(update.shards) or update.base_hash != base.weights_hash():
            return None
        try:
            delta = await self.fetch_update(update)
        except (RemoteProtocolError, TransportError, trio.TooSlowError, OSError) as exc:
            log.info("task %s round %d: %s's update not fetched for its check: %s", self.tid[:12], round_, producer,
                     str(exc) or "timed out")
            return None
        started = trio.current_time()
        try:
            gain = await trio.to_thread.run_sync(self._gain, base.weights, delta, corpus, order, round_, producer,
                                                 steps)
        except (OSError, ValueError) as exc:
            # The corpus unreadable here, or an update of another shape than the weights: nothing to judge by.
            log.warning("task %s round %d: %s's update not checked: %s", self.tid[:12], round_, producer, exc)
            return None
        finally:
            self.seconds += trio.current_time() - started
        self._proof_bytes[(round_, producer)] = sealed
        return gain

    def _gain(self, base: Named, delta, corpus: Path, order: list[int], round_: int, producer: str,
              steps: int) -> float:
        ranges, _ = split_ranges(corpus.stat().st_size, self.spec.dataset.num_shards)
        with open(corpus, "rb") as f:
            data = b"".join(_read(f, *ranges[i]) for i in order)
        own = training_check.own_batches(data, self.model.seq_len, self.spec.batch_size,
                                         derive_seed(self.tid, round_, producer), steps)
        return training_check.own_gain(self.model, base, delta, own)


def shards_of(task_id: str, round_: int, peer: str, members: list[str], num_shards: int) -> list[int]:
    """The data shards ``peer`` trains on in round ``round_`` with these members, in the order it reads them
    (a member the assignment leaves out, when there are fewer shards than members, gets one by its seed)."""
    return assign_shards(task_id, round_, members, num_shards).get(peer) or \
        [derive_seed(task_id, round_, peer) % num_shards]


def _read(f, start: int, end: int) -> bytes:
    f.seek(start)
    return f.read(end - start)


def _trim(d: OrderedDict) -> None:
    for k in sorted(d)[:-KEEP_ROUNDS]:
        del d[k]

