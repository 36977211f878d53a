"""Training checks: each round, every contributor's update is checked by one other contributor, chosen by
rendezvous (protocol.rendezvous.checker), for whether it trained on its own data (node/tasks/training_check.py).

The checker fetches the whole update, applies it to the round's weights and measures the loss on the first
batches its producer drew. An update that makes them worse by more than the threshold did not train on them
(a replayed or copied update, or one made up): the checker charges its producer and gossips a TrainingProof
that carries the producer's own sealed announcement. Every node that holds the round's weights measures it
again and charges the producer too, or, when its own measure clears the update, charges the accuser.
A second finding against one producer within training_check.STRIKE_ROUNDS rounds bans it (protocol/scores.py
``untrained_again``), which
drops its updates on every honest node alike, since every one of them measured the same.

What is checked: tiny-lm and hf-causal-lm tasks whose members train a whole round from its weights (no ``overlap``:
steps carried from the last round trained on other batches; no ``fragments``: a member trains on from its own
weights) and updates of training_check.CHECK_MIN_STEPS to CHECK_MAX_STEPS inner steps. Updates are measured by this
node's trainer child, never on the daemon's threads: tiny-lm's by node/train/check.py, an hf update's by the child
that holds the model (``measure``, node/train/recipes.py ``gain``), against
the method's threshold (UNTRAINED_GAIN_HF); hf updates are not judged as copies (their data does not tell a copy
from an original), and hf-dpo updates not at all (their margins do not tell a replay from an honest update).
An update is judged on the shards it names (a producer reads its shards in that order): an honest producer
names what it trained on, whatever a checker's view of the round's members. One whose base is not the round's
weights here is not judged: nobody is charged on a guess.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
import trio

from node.tasks import compute, training_check
from node.train import check
from node.train.client import TrainerClient, TrainerCrashed, TrainerRequestFailed
from node.train.data import derive_seed, split_ranges
from node.train.diloco import Named, flatten, save_named, unflatten
from protocol.envelope import open_sealed
from protocol.errors import RemoteProtocolError, TransportError
from protocol.rendezvous import assign_shards, checker
from protocol.task import TaskSpec, TrainingProof, UpdateAnnounce

log = logging.getLogger("shoal.tasks")

KEEP_ROUNDS = 3
"""Rounds whose weights, applied mean and sealed updates are kept for checks: the last applied and the two
before. A check fetches the update before it measures, and on fast rounds it and the proof it sends can outlast
two rounds; a proof about an older round is not followed."""
MAX_FINDINGS = 32
"""Untrained updates remembered for operators (``shoal task show``)."""
MAX_CHECKS_PER_ROUND = 64
"""Checks one node runs for one round at most (its own share is about one): proofs beyond are not followed."""
KEPT_UPDATE_BYTES = 256 << 20
"""Fetched updates kept in memory for a second measure of the same update (a peer's proof that it copied one this
node did not measure it against), while their round is kept: by then the slices may be released everywhere."""


class TrainingChecks:
    def __init__(self, *, spec: TaskSpec, task_id: str, me: str, fetch_update: Callable[[UpdateAnnounce], Awaitable],
                 applied_mean: Callable[[int], Callable[[], object] | None], penalize: Callable[[str, str], None],
                 publish: Callable[[object], Awaitable[None]], corpus: Callable[[], Path | None], enabled: bool,
                 max_bytes: int, measure: Callable[..., Awaitable[tuple[float, float] | None]] | None = None,
                 trainer: Callable[[], TrainerClient | None] = lambda: None, folder: Path | None = None):
        self.spec, self.tid, self.me = spec, task_id, me
        self.fetch_update, self.penalize, self.publish, self.corpus = fetch_update, penalize, publish, corpus
        self.applied_mean = applied_mean
        """A round's mean update as applied here, to decode (Exchange.applied_mean): the reference a copy is told
        by."""
        self.measure = measure
        """For hf tasks: (round, producer, θ_r, Δ̂ flat, its shards) -> (its own-data gain, the seconds measuring
        it), measured by the trainer child, or None when it could not be; None for tiny-lm, whose gains this asks
        of ``trainer`` itself."""
        self.trainer, self.folder = trainer, folder
        """This node's trainer child (None while it is down or let go: then measured on a thread here), and where
        the files it measures by are written."""
        self.enabled = enabled and spec.overlap == 0 and spec.fragments <= 1 and training_check.judged(spec.inner_steps)
        self.max_bytes = max_bytes
        self.model = compute.model_config(spec) if self.enabled and measure is None else None
        self.threshold = training_check.UNTRAINED_GAIN if measure is None else \
            training_check.UNTRAINED_GAIN_HF[spec.hf.method]
        self.counts: Counter[str] = Counter()
        """Checks by outcome: passed, untrained (found here), confirmed, refuted (a peer's proof), unjudged."""
        self.seconds = 0.0
        """Seconds spent measuring, as the trainer child timed its measures (with the files written for them):
        the verification compute; neither fetching nor waiting for the trainer counts."""
        self.findings: list[dict] = []
        self.strikes: Counter[str] = Counter()
        """Untrained updates found or confirmed here, per producer, this task."""
        self._found_in: dict[str, list[int]] = {}
        """Per producer, the rounds of its latest findings."""
        self._bases: OrderedDict[int, tuple[compute.OuterState, Callable[[], object] | None]] = OrderedDict()
        """Per kept round, θ_r and its applied mean to decode (applied_mean), both taken when the round is applied
        here: a check outlasts fast rounds (it fetches the update first), and rounds applied meanwhile must not
        take what it measures by away."""
        self._trained: OrderedDict[int, None] = OrderedDict()
        """The last rounds this node trained in: only a producer of the round judges its others."""
        self._sealed: OrderedDict[tuple[int, str], tuple[UpdateAnnounce, bytes]] = OrderedDict()
        self._gains: dict[tuple[int, str], dict[str, float] | None] = {}
        """Per (round, producer), its update's gain on its own batches and on others' (by whose), measured here
        once (None: it cannot be judged here)."""
        self._unjudged: dict[tuple[int, str], set[str]] = {}
        """Per (round, producer), the owners whose batches cannot be judged here (not asked again)."""
        self._copies: dict[int, list[str]] = {}
        """Per round, the producers the screen left out as near copies of each other."""
        self._running: dict[tuple[int, str], trio.Event] = {}
        self._updates: OrderedDict[tuple[int, str], object] = OrderedDict()
        """Per (round, producer), its update as fetched for a check, up to KEPT_UPDATE_BYTES in all."""
        self._per_round: Counter[int] = Counter()
        self._pending: dict[int, list[tuple[str, str, str | None]]] = {}
        """Per round not applied here yet, the proofs that arrived early: (producer, accuser, original)."""
        self._votes: dict[int, bool] = {}
        """Per round closed here, whether this node's weights were the vote's: only then is the mean it applied
        (R, by which a copy is told) the one its peers measure by."""
        self._voted: dict[int, trio.Event] = {}
        """Per round, set once it closed here (_agreed waits on it)."""

    # -- what the runner tells it ----------------------------------------------------------------

    def heard(self, msg: UpdateAnnounce, sealed: bytes) -> None:
        """An update announced on the task topic, as its producer sealed it (the proof carries these bytes)."""
        if self.enabled and msg.shards:
            self._sealed[(msg.round, msg.producer)] = (msg, sealed)
            while len(self._sealed) > (KEEP_ROUNDS + 2) * self.spec.max_members:
                self._sealed.popitem(last=False)

    def trained(self, round_: int) -> None:
        """This node trained in round ``round_``."""
        if self.enabled:
            self._trained[round_] = None
            _trim(self._trained)

    def applied(self, round_: int, base: compute.OuterState, contributors: list[str], nursery: trio.Nursery,
                copies: list[str] = ()) -> None:
        """Round ``round_`` was applied from ``base`` (θ_r) with these contributors: check those this node is
        the checker of. ``copies``: producers the screen left out as near copies of each other, checked too
        (drawn among the contributors alike): the copy did not train on its own batches, the original did."""
        if not self.enabled or round_ not in self._trained:
            return
        self._bases[round_] = base, self.applied_mean(round_)
        _trim(self._bases)
        oldest = round_ - KEEP_ROUNDS + 1
        for table in (self._gains, self._sealed, self._unjudged, self._updates):
            for old in [k for k in table if k[0] < oldest]:
                del table[old]
        self._copies[round_] = list(copies)
        for table in (self._per_round, self._pending, self._copies):
            for old in [r for r in table if r < oldest]:
                del table[old]
        for claim in self._pending.pop(round_, []):
            nursery.start_soon(self._check, round_, *claim)
        if self.me not in contributors:
            return  # a member that did not contribute holds no vote on others' work this round
        for producer in sorted({*contributors, *copies}):
            if producer != self.me and checker(self.tid, round_, producer, contributors) == self.me:
                nursery.start_soon(self._check, round_, producer, None)

    def closed(self, round_: int, agreed: bool) -> None:
        """Round ``round_`` closed here, with this node's weights the vote's (``agreed``) or not."""
        if self.enabled:
            self._votes[round_] = agreed
            self._voted.setdefault(round_, trio.Event()).set()
            for table in (self._votes, self._voted):
                for old in [r for r in table if r < round_ - KEEP_ROUNDS - 2]:
                    del table[old]

    async def _agreed(self, round_: int) -> bool:
        """Whether this node's weights of ``round_`` were the vote's, waiting for the round to close here (at most
        a round's deadline): a copy is told by the round's applied mean, which differs on a node that applied
        other aggregates (it fetches the vote's weights after), so such a node neither accuses nor refutes."""
        with trio.move_on_after(self.spec.round_deadline_s):
            await self._voted.setdefault(round_, trio.Event()).wait()
        return self._votes.get(round_, False)

    def proof(self, proof: TrainingProof, origin: str, nursery: trio.Nursery) -> None:
        """A peer's TrainingProof: measured again here, unless it is malformed or about this node."""
        opened = [self._open(sealed, origin) for sealed in (proof.update, proof.original) if sealed]
        if any(m is None for m in opened):
            return
        msg, original = opened[0], (opened[1] if len(opened) > 1 else None)
        if original is not None and (original.round != msg.round or original.producer == msg.producer):
            self.penalize(origin, "malformed")
            return
        if not self.enabled or msg.producer == self.me:
            return
        self._sealed.setdefault((msg.round, msg.producer), (msg, proof.update))
        if original is not None:
            self._sealed.setdefault((msg.round, original.producer), (original, proof.original))
        claim = (msg.producer, proof.accuser, original.producer if original is not None else None)
        gone = bool(self._bases) and msg.round < min(self._bases)
        log.info("task %s round %d: %s's proof against %s's update%s (%s)", self.tid[:12], msg.round, proof.accuser,
                 msg.producer, "" if original is None else f" as a copy of {original.producer}'s",
                 "measured here" if msg.round in self._bases else "for a round no longer kept here" if gone
                 else "for a round not applied here yet")
        if msg.round in self._bases:
            nursery.start_soon(self._check, msg.round, *claim)
        elif gone:
            self.counts["unjudged"] += 1
        elif self._trained and max(self._trained) <= msg.round <= max(self._trained) + 1 and \
                len(self._pending.get(msg.round, ())) < MAX_CHECKS_PER_ROUND:
            # A proof about the round this node is still closing: measured once it is applied here.
            self._pending.setdefault(msg.round, []).append(claim)

    def _open(self, sealed: bytes, origin: str) -> UpdateAnnounce | None:
        try:
            inner = open_sealed(sealed, max_bytes=self.max_bytes, expect=UpdateAnnounce)
        except RemoteProtocolError:
            self.penalize(origin, "malformed")
            return None
        if inner.signer != inner.message.producer or inner.message.task_id != self.tid:
            self.penalize(origin, "impersonation")
            return None
        return inner.message

    def status(self) -> dict:
        return {"enabled": self.enabled, **{k: self.counts[k] for k in
                                            ("passed", "untrained", "confirmed", "refuted", "unjudged")},
                "seconds": round(self.seconds, 3), "findings": list(self.findings)}

    # -- the check -------------------------------------------------------------------------------

    async def _check(self, round_: int, producer: str, accuser: str | None, original: str | None = None) -> None:
        """Judge ``producer``'s update of ``round_``: as its checker (``accuser`` None), or a peer's proof that it
        did not train, or (``original``) that it is that producer's copy."""
        copies = self._copies.get(round_, ())
        others = [original] if original is not None else \
            [p for p in copies if p != producer] if producer in copies else []
        held = self._sealed.get((round_, producer)), {p: self._sealed.get((round_, p)) for p in others}
        # The round's weights and mean as they were when the check began: it may wait for another measure of the
        # same update, and rounds applied meanwhile must not take them away.
        gains = await self._measured(round_, producer, others, self._bases.get(round_))
        if gains is None or producer not in gains or (original is not None and original not in gains):
            self.counts["unjudged"] += 1
            log.info("task %s round %d: %s's update not judged here%s (%s)", self.tid[:12], round_, producer,
                     "" if original is None else f" against {original}'s batches",
                     "it cannot be" if gains is None else "not those batches")
            return
        if (original is not None or any(p in gains for p in others)) and not await self._agreed(round_):
            # Judged by a mean its peers did not apply: the copy (or the proof) goes unjudged here, and the
            # update is judged on its own batches alone, which need only θ_r.
            if original is not None:
                self.counts["unjudged"] += 1
                log.info("task %s round %d: %s's update not judged here against %s's batches (this node's weights "
                         "of the round were not the vote's)", self.tid[:12], round_, producer, original)
                return
            gains = {producer: gains[producer]}
            others = []
        own = gains[producer]
        log.debug("task %s round %d: %s measured %s's update: %s", self.tid[:12], round_, self.me, producer,
                  {p[-6:]: round(g, 4) for p, g in gains.items()})
        if accuser is None:
            # What the proof carries, as it was heard when the check began: a check can outlast the rounds kept.
            update, origins = held
            copy_of = next((p for p in others if p in gains and training_check.copied(gains[p])), None)
            if not training_check.untrained(own, self.threshold) and copy_of is None:
                self.counts["passed"] += 1
                return
            if training_check.untrained(own, self.threshold):
                copy_of = None
            self.counts["untrained"] += 1
            self._found(round_, producer, own, by=self.me, copy_of=copy_of, advantage=gains.get(copy_of))
            origin = origins.get(copy_of) if copy_of is not None else None
            if update is not None and (copy_of is None or origin is not None):
                await self.publish(TrainingProof(
                    task_id=self.tid, accuser=self.me, update=update[1], gain=own,
                    **({} if origin is None else {"original": origin[1], "advantage": gains[copy_of]})))
        elif training_check.confirms(own, self.threshold) if original is None \
                else training_check.confirms_copy(gains[original]):
            self.counts["confirmed"] += 1
            self._found(round_, producer, own, by=accuser, copy_of=original, advantage=gains.get(original))
        else:
            self.counts["refuted"] += 1
            what = "did not train on its data" if original is None else f"copied {original}'s"
            log.warning("task %s round %d: %s says %s's update %s; measured here it gains %.4f on its own batches%s",
                        self.tid[:12], round_, accuser, producer, what, own,
                        "" if original is None else f" and fits them {gains[original]:+.4f} better than {original}'s")
            self.penalize(accuser, "false_accusation")

    def _found(self, round_: int, producer: str, gain: float, *, by: str, copy_of: str | None,
               advantage: float | None) -> None:
        found = "this node" if by == self.me else by
        if copy_of is None:
            log.warning("task %s round %d: %s's update raises the loss on its own batches by %.4f: it did not "
                        "train on them (found by %s)", self.tid[:12], round_, producer, -gain, found)
        else:
            log.warning("task %s round %d: %s's update fits %s's batches better than its own (by %.4f beyond the "
                        "round's mean): a copy of %s's (found by %s)", self.tid[:12], round_, producer, copy_of,
                        -advantage, copy_of, found)
        self.findings = (self.findings + [{"round": round_, "producer": producer, "gain": round(gain, 4),
                                           "found_by": by, "copy_of": copy_of,
                                           "advantage": None if advantage is None else round(advantage, 4)}
                                          ])[-MAX_FINDINGS:]
        # However long its rounds, a producer found in two nearby rounds is banned: the second finding's charge
        # alone reaches the ban.
        self.strikes[producer] += 1
        rounds = self._found_in.setdefault(producer, [])
        rounds.append(round_)
        del rounds[:-4]
        self.penalize(producer, "untrained_again" if training_check.banned_at(sorted(rounds)) else "untrained_update")

    async def _measured(self, round_: int, producer: str, others: list[str],
                        kept: tuple[compute.OuterState, Callable[[], object] | None] | None) -> dict[str, float] | None:
        """``producer``'s update's gain on its own batches (under its own name) and its own_advantage over each
        of ``others`` whose batches can be judged here (under theirs), measured once each; None when the update
        itself cannot be judged."""
        key = (round_, producer)
        while key in self._running:
            await self._running[key].wait()
        gains = self._gains.get(key, {})
        if key in self._gains and (gains is None or all(o in gains or o in self._unjudged.get(key, ()) for o in others)):
            return gains
        if key not in self._gains and self._per_round[round_] >= MAX_CHECKS_PER_ROUND:
            return None
        self._per_round[round_] += key not in self._gains
        self._running[key] = trio.Event()
        try:
            owners = [o for o in [producer, *others] if o not in gains]
            measured = await self._measure(round_, producer, owners, gains, kept)
            if measured is None and gains:
                # Measured before, not again now: what was measured stands, the new owners go unjudged.
                self._unjudged.setdefault(key, set()).update(owners)
            else:
                self._gains[key] = measured
        finally:
            self._running.pop(key).set()
        return self._gains[key]

    def _batches_of(self, round_: int, owner: str) -> tuple[list[int], int] | None:
        """(shards in reading order, steps) of ``owner``'s update of ``round_``, if it is judged: the shards its
        UpdateAnnounce names, which a producer reads in that (sorted) order. Its own word, and safe to take: an
        honest producer names what it trained on, whatever this node's view of the round's members, and a
        producer that names other shards is judged on batches its update never saw. None too for shards the task
        does not have (a message may name up to the protocol's cap)."""
        got = self._sealed.get((round_, owner))
        if got is None:
            return None
        update = got[0]
        steps = update.samples // self.spec.batch_size
        known = all(i < self.spec.dataset.num_shards for i in update.shards)
        return (list(update.shards), steps) if training_check.judged(steps) and update.shards and known else None

    async def _measure(self, round_: int, producer: str, owners: list[str], gains: dict[str, float],
                       kept: tuple[compute.OuterState, Callable[[], object] | None] | None
                       ) -> dict[str, float] | None:
        """``gains`` with ``producer``'s update measured for each owner (_measured) by ``kept``, the round's
        (θ_r, applied mean); None when the update cannot be judged (its batches or base are not this node's view
        of the round, or it cannot be fetched)."""
        got, corpus = self._sealed.get((round_, producer)), self.corpus()
        base, mean = kept or (None, None)
        own = self._batches_of(round_, producer)
        if got is None or base is None or corpus is None or own is None or got[0].base_hash != base.weights_hash():
            log.info("task %s round %d: %s's update not judged: %s", self.tid[:12], round_, producer,
                     "never heard" if got is None else "the round's weights are not kept here" if base is None
                     else "no corpus here" if corpus is None else "too few steps, or no shards named" if own is None
                     else "trained from other weights than this node's")
            return None
        reference = mean if self.measure is None and any(o != producer for o in owners) else None
        batches = {o: b for o in owners if (b := self._batches_of(round_, o)) is not None
                   and (o == producer or reference is not None)}
        self._unjudged.setdefault((round_, producer), set()).update(o for o in owners if o not in batches)
        delta = await self._fetched(got[0])
        if delta is None:
            return None
        if self.measure is not None:
            got = await self.measure(round_, producer, base.weights, delta, own[0]) if producer in batches else None
            if got is None:
                return None
            gain, seconds = got
            self.seconds += seconds
            return {**gains, producer: gain}
        try:
            measured, seconds = await self._gains_on(base.weights, delta, corpus, round_, producer, own, batches,
                                                     reference)
        except (TrainerRequestFailed, OSError, ValueError) as exc:
            # The corpus unreadable here, or an update of another shape than the weights (the trainer refused
            # it): nothing to judge by.
            log.warning("task %s round %d: %s's update not checked: %s", self.tid[:12], round_, producer, exc)
            return None
        self.seconds += seconds
        return {**gains, **measured}

    async def _fetched(self, update: UpdateAnnounce):
        """``update`` as fetched (Exchange.fetch_update), or as kept from an earlier check of it; None when it
        cannot be fetched."""
        key = (update.round, update.producer)
        if key in self._updates:
            return self._updates[key]
        log.debug("task %s round %d: fetching %s's update to check it", self.tid[:12], *key)
        try:
            delta = await self.fetch_update(update)
        except (RemoteProtocolError, TransportError, trio.TooSlowError, OSError) as exc:
            log.info("task %s round %d: %s's update not fetched for its check: %s", self.tid[:12], *key,
                     str(exc) or "timed out")
            return None
        if delta.numel() * delta.element_size() <= KEPT_UPDATE_BYTES:  # dropped with its round (applied)
            self._updates[key] = delta
            while sum(d.numel() * d.element_size() for d in self._updates.values()) > KEPT_UPDATE_BYTES:
                self._updates.popitem(last=False)
        return delta

    async def _gains_on(self, base: Named, delta, corpus: Path, round_: int, producer: str,
                        own: tuple[list[int], int], batches: dict[str, tuple[list[int], int]],
                        reference: Callable[[], object] | None) -> tuple[dict[str, float], float]:
        """The measures (node/train/check.py ``measure``), by this node's trainer child: per owner in
        ``batches``, the producer's own gain or its advantage over that owner's batches; and their seconds."""
        ranges, _ = split_ranges(corpus.stat().st_size, self.spec.dataset.num_shards)
        drawn = {owner: {"shard_ranges": [list(ranges[i]) for i in order], "steps": steps,
                         "seed": derive_seed(self.tid, round_, owner)}
                 for owner, (order, steps) in {producer: own, **batches}.items()}
        others = [o for o in batches if o != producer]
        trainer = self.trainer()
        try:
            if trainer is None or self.folder is None:
                raise TrainerCrashed("no trainer")
            reply = await ask_trainer(trainer, self.folder, round_, producer, base,
                                      {"delta": lambda: delta, **({"reference": reference} if others else {})},
                                      model=dataclasses.asdict(self.model), data_path=str(corpus),
                                      producer=producer, owners=list(batches), batches=drawn,
                                      batch_size=self.spec.batch_size)
        except TrainerCrashed:
            # The trainer let go (the task is over here, and a check or a peer's proof about its last rounds came
            # late) or restarting: measured on a thread here, as every node that holds the round must be able to.
            return await trio.to_thread.run_sync(self._gains_here, base, delta, corpus, drawn, producer,
                                                 list(batches), reference if others else None)
        gains = reply.get("gains")
        if not isinstance(gains, dict) or set(gains) != set(batches):
            raise ValueError(f"the trainer measured {sorted(gains or ())}, not {sorted(batches)}")
        return {str(k): float(v) for k, v in gains.items()}, reply["seconds"]

    def _gains_here(self, base: Named, delta, corpus: Path, wanted: dict, producer: str, owners: list[str],
                    reference: Callable[[], object] | None) -> tuple[dict[str, float], float]:
        started = time.monotonic()
        drawn = check.draw(corpus, self.model.seq_len, self.spec.batch_size, wanted, producer, owners)
        gains = check.measure(self.model, base, delta, reference() if reference is not None else None, drawn,
                              producer, owners)
        return gains, time.monotonic() - started


async def ask_trainer(trainer: TrainerClient, folder: Path, round_: int, producer: str, base: Named,
                      flats: dict[str, Callable[[], torch.Tensor]], /, **fields) -> dict:
    """The trainer child's "gain" reply about ``producer``'s update of ``round_``: ``base`` and each of ``flats``
    (flat, in base's layout, made in a thread) go to it as files in ``folder`` (fields base_path and
    <name>_path), removed after. Its "seconds": the child's, with the files' writing. Raises what the trainer or
    the disk raise."""
    stem = f"check-r{round_}-{hashlib.sha256(producer.encode()).hexdigest()[:16]}"
    paths = {name: folder / f"{stem}-{name}.safetensors" for name in ("base", *flats)}

    def write() -> float:
        started = time.monotonic()
        _, layout = flatten(base)
        save_named(paths["base"], base, durable=False)
        for name, make in flats.items():
            save_named(paths[name], unflatten(make().to(torch.float32), layout), durable=False)
        return time.monotonic() - started

    try:
        written = await trio.to_thread.run_sync(write)
        reply = await trainer.request("gain", **fields, **{f"{name}_path": str(p) for name, p in paths.items()})
        return {**reply, "seconds": written + float(reply.get("seconds", 0.0))}
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)


def shards_of(task_id: str, round_: int, peer: str, members: list[str], num_shards: int) -> list[int]:
    """The data shards ``peer`` trains on in round ``round_`` with these members, in the order it reads them
    (a member the assignment leaves out, when there are fewer shards than members, gets one by its seed)."""
    return assign_shards(task_id, round_, members, num_shards).get(peer) or \
        [derive_seed(task_id, round_, peer) % num_shards]


def _trim(d: OrderedDict) -> None:
    for k in sorted(d)[:-KEEP_ROUNDS]:
        del d[k]

