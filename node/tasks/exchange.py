"""A task's SHARDCAST traffic: update slices, aggregates, weights and the dataset, each verified on arrival.

It knows nothing of the runner: it is handed the store, the spec, the model's size and how to charge a peer, and it
answers the task machine's work effects (Aggregate, Apply, FetchState) with their results.
Past 500 lines: every fetch and publish of a task's bytes shares one verification path (_fetch) and one
release bookkeeping (_slices, _aggregates, _states), which a split would have to pass between modules.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import trio

from node.tasks import compute, robust, task_files
from node.train.codecs import CODECS, INT8, Codec
from node.train.diloco import load_named
from protocol.audit import UNDECODABLE, Verified, Verify
from protocol.envelope import seal
from protocol.errors import IntegrityError, LocalStoreError, RemoteProtocolError, TaskRejected, TransportError
from protocol.keys import Keypair
from protocol.manifest import KIND_FILE, KIND_TENSORS, Manifest, layout_tensors, manifest_id
from protocol.round import Head, round_work
from protocol.task import DatasetOffer, TaskSpec, UpdateAnnounce
from protocol.task_machine import AHEAD_ROUNDS, Aggregate, Aggregated, Apply

log = logging.getLogger("shoal.tasks")

AGGREGATE_FETCH_SHARE = 0.5
"""An aggregator fetches producers' slices for at most this share of the round deadline, then combines
what arrived. Members gather for one round deadline: a producer that announced and then died (a SIGKILL)
or stalls must cost the slice its contribution, not make the aggregate miss that deadline everywhere."""
PRODUCER_GONE_S = 1.0
"""Nor does it wait for a producer's slice once the producer has been gone this long (its connections closed, or
silent past the membership's suspect time): the slice would come only when a restarted process serves it, if it
comes back at all, while the round waits on this aggregate."""
GONE_POLL_S = 0.2
STATE_ASK_SHARE = 0.25
"""Before fetching weights from a source, it is asked whether it still holds them, for at most this share of the
round deadline: one that cannot answer (its connection died with a partition and is not yet redialled) is
passed over then, not waited on for the whole fetch deadline while other members hold the same weights."""
SCREENED = {"empty": "next to nothing (zeros)",
            "duplicate": "a near copy of another producer's slice (both left out; the training checks tell which)",
            "opposed": "it points against the others' median",
            "outsized": "many times larger than the others (noise poured in)",
            "one_sided": "on one side of the others' median nearly everywhere (crafted inside their spread)"}
APPLIED_KEPT = 1
"""Rounds whose applied aggregates are kept here: the last. The training checks take the round's mean
(applied_mean) when they are told it is applied, and keep it as long as they need it."""
AGGREGATE_RETENTION_DEADLINES = 2.0
"""A round's aggregates are kept this many round deadlines past their two rounds: a joiner whose fetch of the
weights (bounded by one round deadline) outlasted a few short rounds follows those rounds with them. Never more
than AGGREGATE_RETENTION_ROUNDS rounds back, though: a joiner further behind fetches the weights again."""
AGGREGATE_RETENTION_ROUNDS = AHEAD_ROUNDS + 2
"""Rounds of aggregates kept behind the one just applied, whatever the time: a joiner follows at most AHEAD_ROUNDS
rounds (protocol/task_machine.py _can_follow), and the two more are margin. Short rounds under a long deadline kept
every aggregate of a task's last two deadlines before (2.8x the model after the late-joiner process test)."""


class Exchange:
    def __init__(self, *, shardcast, spec: TaskSpec, task_id: str, directory: Path, keypair: Keypair,
                 penalize: Callable[[str, str], None], num_params: Callable[[], int],
                 banned: Callable[[str], bool] = lambda peer: False, gone: Callable[[str], bool] = lambda peer: False,
                 fragment: Callable[[int], tuple[tuple[str, ...], int] | None] = lambda round_: None):
        self.shardcast, self.spec, self.tid, self.dir = shardcast, spec, task_id, directory
        self.codec = CODECS[spec.compression]
        """How the producers' slices are encoded."""
        self.out = CODECS[spec.aggregate_compression]
        """How the aggregates are encoded (block-wise: int8 unless the task says otherwise)."""
        self.num_params = num_params
        """Values of the model's exchanged tensors (known for an hf recipe only once the trainer has drawn θ_0)."""
        self.fragment = fragment
        """(the tensors round r syncs, their values) under the task option ``fragments``; None: the whole model."""
        self.me, self.keypair, self.penalize, self.banned = keypair.peer_id, keypair, penalize, banned
        self.gone = gone
        """Whether a peer is gone by the membership's account (it says nothing of ourselves)."""
        self.screened: Counter[str] = Counter()
        """Slices this node's aggregations left out by the screen, by reason (robust.screen's)."""
        self.offers: dict[str, DatasetOffer] = {}
        self._offers_changed = trio.Event()
        self._offer_path: Path | None = None
        self._offer_id = ""
        self._offer_sealed = b""
        self._slices: dict[int, set[bytes]] = {}
        """Manifests of each round's update slices here (ours and fetched), released two rounds after it is applied."""
        self._aggregates: dict[int, set[bytes]] = {}
        """Each round's aggregates (ours and fetched), kept a round longer still, for peers that follow behind."""
        self.aggregate_retention_s = AGGREGATE_RETENTION_DEADLINES * spec.round_deadline_s
        self._residual: tuple[int, compute.Named] | None = None
        """(round, the error-feedback residual its update left): what the next round's update adds."""
        self.slices_kept_rounds = 1
        """Rounds a round's slices outlive it: one by default (a slow aggregator may still be fetching); as many as
        the training checks keep rounds when they run (node/tasks/checks.py KEEP_ROUNDS), for a check or a proof
        that fetches whole updates after their round is applied: a check may begin as late as its round's last
        kept one, and its producer be a round ahead of it by then."""
        self._aggregates_done_at: dict[int, float] = {}
        self.verify_compute_s = 0.0
        """Seconds recomputing others' aggregates once their inputs were fetched (verify): its compute."""
        self._state: bytes | None = None
        """The state this node serves (published or fetched here last; see _keep_state)."""
        self._applied: dict[int, list] = {}
        """The aggregates of the last rounds applied here (training checks measure against their mean)."""

    # -- fetching with verification ------------------------------------------------------------

    async def _fetch(self, manifest_hex: str, signer: str, timeout_s: float, *,
                     verify: bool = True, announce: bool = True) -> tuple[Manifest, dict]:
        """Fetch a tensors manifest signed by ``signer``; IntegrityError/TransferTimeout on failure.
        ``verify=False``: the store hashed every shard where it arrived or was made; not again on reading.
        ``announce``: see ShardcastService.fetch."""
        mid = bytes.fromhex(manifest_hex)
        with trio.fail_after(timeout_s):
            # Only the signer's copy will do: anyone may sign a copy of another's manifest (the id is the same), and
            # one answered to us first must not make an honest producer's slice look forged.
            manifest = await self.shardcast.fetch(mid, signer=signer, announce=announce)
        if manifest.kind != KIND_TENSORS:
            raise IntegrityError(f"manifest {manifest_hex[:16]} holds a file, not tensors")
        try:
            tensors = await trio.to_thread.run_sync(lambda: self.shardcast.load_tensors(manifest, verify=verify))
        except LocalStoreError:
            # Our own disk rotted, not the signer's bytes: the bad shard was dropped, so fetch it again.
            with trio.fail_after(timeout_s):
                manifest = await self.shardcast.fetch(mid, signer=signer, announce=announce)
            tensors = await trio.to_thread.run_sync(self.shardcast.load_tensors, manifest)
        return manifest, tensors

    async def _fetch_payload(self, manifest_hex: str, signer: str, numel: int, timeout_s: float, *,
                             kept: dict[int, set[bytes]], round_: int, codec: Codec = INT8):
        """(manifest, the payload as a uint8 view), remembered under ``round_`` in ``kept`` for release. An update's
        slice of one shard is fetched quietly: its producer serves each of the few that need it (publish_update), and
        a Have of it would be gossiped to every member for nothing. An aggregate, which every member fetches, and a
        slice of several shards, which its aggregators pass on to each other shard by shard, are announced."""
        kept.setdefault(round_, set()).add(bytes.fromhex(manifest_hex))
        announce = kept is not self._slices or not self._one_shard(codec.size(numel))
        manifest, tensors = await self._fetch(manifest_hex, signer, timeout_s, verify=False, announce=announce)
        return manifest, compute.payload_view(manifest, tensors, numel, codec)

    def _one_shard(self, nbytes: int) -> bool:
        return nbytes <= self.shardcast.config.shard_bytes

    def round_numel(self, round_: int | None) -> int:
        """Values round ``round_`` exchanges: its fragment's, or the whole model's."""
        part = self.fragment(round_) if round_ is not None else None
        return self.num_params() if part is None else part[1]

    def _slice_numel(self, slice_index: int, round_: int | None = None) -> int:
        a, b = compute.slice_bounds(self.round_numel(round_), self.spec.aggregation_shards)[slice_index]
        return b - a

    # -- publishing ------------------------------------------------------------------------------

    async def publish_payload(self, data: bytearray, label: str, version: int | None = None, *,
                              seed: bool = True) -> str:
        """One encoded payload as a one-tensor manifest, published straight from its buffer; ``seed``: see
        ShardcastService.publish_blob."""
        return _manifest_hex(await self._publish_payload(data, label, version, seed=seed))

    async def _publish_payload(self, data: bytearray, label: str, version: int | None = None, *,
                               seed: bool = True) -> Manifest:
        entries, _ = layout_tensors([(compute.PAYLOAD, "uint8", (len(data),))])
        return await self.shardcast.publish_blob(data, entries, label=label, version=version, durable=False,
                                                 seed=seed)

    async def publish_update(self, delta_path: Path, round_: int) -> list[str]:
        """The trainer's Δ for ``round_``, encoded slice by slice at the task's compression and published: one
        manifest id per slice. With a codec that keeps feedback (below 8 bits, top-k): what it dropped from
        this node's last update is added to this one, and what it drops now is kept for the next (in memory, and
        on disk for a restart)."""
        delta = await trio.to_thread.run_sync(load_named, delta_path)
        if self.codec.feedback:
            # The last residual made here, from memory; after a restart, or to redo a round, from disk.
            kept = self._residual
            residual = kept[1] if kept is not None and kept[0] < round_ else \
                await trio.to_thread.run_sync(task_files.load_residual, self.dir, round_)
            payloads, residual = await trio.to_thread.run_sync(
                compute.fragment_with_feedback, delta, self.spec.aggregation_shards, self.codec, residual)
            self._residual = (round_, residual)
            # On disk for a restart, written off the round's path (lost in a crash, it costs only precision).
            await trio.to_thread.run_sync(task_files.save_residual, self.dir, round_, residual, True)
        else:
            payloads = await trio.to_thread.run_sync(compute.split_update, delta, self.spec.aggregation_shards)
        # Versioned by round, not by the clock: the same bytes published again are the same manifests.
        # A slice goes to its few aggregators (and, once the round is applied, its checker). One of a single shard is
        # not seeded: the producer serves each, and they fetch it quietly (_fetch_payload); seeded, the second would
        # wait for the first's whole copy and its Have, gossiped to every member. A slice of several shards is seeded,
        # so that the aggregators pass shards on to each other while the producer sends each about once.
        ids = [await self.publish_payload(p, f"task/{self.tid[:12]}/r{round_}/u{s}", version=round_,
                                          seed=not self._one_shard(len(p)))
               for s, p in enumerate(payloads)]
        self._slices.setdefault(round_, set()).update(bytes.fromhex(i) for i in ids)
        return ids

    def holds_update(self, round_: int, manifest_ids) -> bool:
        """Whether the store still holds every shard of these slices (an update published before a restart);
        if so they are kept, and released, with the round's other slices."""
        mids = [bytes.fromhex(i) for i in manifest_ids]
        if not all(self._held_whole(m) for m in mids):
            return False
        self._slices.setdefault(round_, set()).update(mids)
        return True

    def _held_whole(self, mid: bytes) -> bool:
        """Whether the store holds the manifest and every shard of it."""
        store = self.shardcast.store
        signed = store.get_manifest(mid)
        return signed is not None and all(store.has_shard(h) for h in signed.manifest.shard_hashes)

    async def publish_state(self, state: compute.OuterState, label: str) -> str:
        """θ and the outer state for joiners and dissenters, served from the state's own memory (its tensors never
        change in place): no copy on disk, which would be 2x the model written each round and kept in the store.
        The previous state published here is released; while a peer still fetches it, its tensors stay in memory
        with it (two round deadlines at most). The checkpoint, not the store, is what survives a crash. Its manifest
        (a line per tensor) is not gossiped: a node that fetches the state asks its source first (fetch_state), and
        the answer brings the manifest."""
        m = await self.shardcast.publish_tensors(state.state_tensors(), label=label, in_memory=True, gossip=False)
        await self._keep_state(manifest_id(m))
        return _manifest_hex(m)

    async def _keep_state(self, mid: bytes) -> None:
        """Serve ``mid`` as our state from now on and release the one before: a state is 2x the model, and a
        node keeps one. A peer half-way through fetching the old one still gets it (the store keeps a released
        manifest while peers ask for it, ShardcastConfig.serving_grace_s); one that asks after is told we no
        longer hold it (fetch_state), and takes the newer weights."""
        old, self._state = self._state, mid
        if old is not None and old != mid:
            # Kept for a fetch under way no longer than a joiner's fetch may take (one round deadline), and one more.
            await self.shardcast.release([old], hold_s=2 * self.spec.round_deadline_s)

    async def collect(self, applied_round: int) -> None:
        """Release what the rounds before ``applied_round`` needed: slices slices_kept_rounds rounds after they are
        applied (a slow aggregator may still be fetching, a training check measuring), aggregates two rounds and
        aggregate_retention_s after (followers apply them), or once AGGREGATE_RETENTION_ROUNDS rounds behind if that
        comes first."""
        now = trio.current_time()
        done = [r for r in self._slices if r < applied_round - self.slices_kept_rounds]
        # Aggregates also outlive their two rounds by aggregate_retention_s: a joiner that synced a few short
        # rounds behind follows them, and must find them.
        for r in self._aggregates:
            if r < applied_round - 1:
                self._aggregates_done_at.setdefault(r, now)
        done_aggregates = [r for r, t in self._aggregates_done_at.items()
                           if now - t >= self.aggregate_retention_s or r < applied_round - AGGREGATE_RETENTION_ROUNDS]
        for r in done_aggregates:
            del self._aggregates_done_at[r]
        ids = set().union(*(self._slices.pop(r) for r in done),
                          *(self._aggregates.pop(r, set()) for r in done_aggregates))
        if ids:
            await self.shardcast.release(ids)

    # -- aggregation -----------------------------------------------------------------------------

    async def aggregate(self, job: Aggregate) -> Aggregated | None:
        """Fetch slice ``job.slice`` from every producer, verify, average and store it (None: nothing arrived)."""
        numel, deadline_s = self._slice_numel(job.slice, job.round), self.spec.round_deadline_s * AGGREGATE_FETCH_SHARE
        got: dict[str, tuple[object, int]] = {}
        sources: dict[str, Manifest] = {}

        pending: dict[str, trio.CancelScope] = {}
        """Per producer whose slice is being fetched, the fetch's scope: cancelled once the producer is gone."""

        async def one(update, scope: trio.CancelScope) -> None:
            with scope:
                try:
                    manifest, data = await self._fetch_payload(update.manifest_ids[job.slice], update.producer, numel,
                                                               deadline_s, kept=self._slices, round_=job.round,
                                                               codec=self.codec)
                    got[update.producer] = (data, update.samples)
                    sources[update.producer] = manifest
                except RemoteProtocolError as exc:
                    log.warning("task %s round %d: slice %d from %s rejected: %s", self.tid[:12], job.round,
                                job.slice, update.producer, exc)
                    self.penalize(update.producer, "corrupt_shard")
                except (TransportError, trio.TooSlowError) as exc:
                    log.info("task %s round %d: slice %d from %s not fetched: %s", self.tid[:12], job.round,
                             job.slice, update.producer, str(exc) or "timed out")
            pending.pop(update.producer, None)
            if scope.cancelled_caught:
                log.info("task %s round %d: slice %d from %s not fetched: its producer is gone", self.tid[:12],
                         job.round, job.slice, update.producer)

        async with trio.open_nursery() as watching:
            watching.start_soon(self._cancel_when_gone, pending)
            async with trio.open_nursery() as nursery:
                for update in job.updates:
                    # A producer this node banned (after it announced) no longer serves us: fetching its slice
                    # would only wait out the fetch deadline.
                    if not self.banned(update.producer):
                        scope = pending[update.producer] = trio.CancelScope()
                        nursery.start_soon(one, update, scope)
            watching.cancel_scope.cancel()
        if not got:
            return None
        screened: dict[str, str] = {}
        try:
            # Decoded once, here, where it is combined: a slice that does not decode is its producer's fault.
            out = await trio.to_thread.run_sync(robust.combine, got, numel, self.spec.aggregation, self.codec,
                                                self.out)
            data, bad, screened = out.data, out.bad, out.screened
        except IntegrityError as exc:
            log.warning("task %s round %d: slice %d not aggregated: %s", self.tid[:12], job.round, job.slice, exc)
            bad, data = list(got), None
        for producer in bad:
            # Read without re-hashing; before blaming the producer, make sure our own disk did not rot its bytes.
            if await trio.to_thread.run_sync(self._intact, sources[producer]):
                self.penalize(producer, "corrupt_shard")
        for producer, why in screened.items():
            # Charged once the aggregate is applied, by every node alike (the runner's ScreenedOut), not here.
            log.warning("task %s round %d: slice %d from %s left out: %s", self.tid[:12], job.round, job.slice,
                        producer, SCREENED[why])
            self.screened[why] += 1
        included = tuple(sorted(p for p in got if p not in bad and p not in screened))
        if data is None or not included:
            return None
        if bad or screened:
            # The aggregate must be what its listed inputs alone give when anyone recomputes them: the result
            # above already left those slices out, but a plain mean that overflowed took the robust path,
            # which the listed slices alone would not take.
            data, _ = await trio.to_thread.run_sync(robust.aggregate_slice, {p: got[p] for p in included}, numel,
                                                    self.spec.aggregation, self.codec, self.out)
        m = await self._publish_payload(data, f"task/{self.tid[:12]}/r{job.round}/a{job.slice}")
        self._aggregates.setdefault(job.round, set()).add(manifest_id(m))
        by_producer = {u.producer: u for u in job.updates}
        left_out = sorted(screened)
        return Aggregated(round=job.round, slice=job.slice, included=included,
                          inputs=tuple(by_producer[p].manifest_ids[job.slice] for p in included),
                          manifest_id=_manifest_hex(m), result_hash=payload_hash(m, data),
                          screened=tuple(left_out),
                          screened_inputs=tuple(by_producer[p].manifest_ids[job.slice] for p in left_out),
                          screened_why=tuple(screened[p] for p in left_out))

    async def fetch_update(self, update: UpdateAnnounce) -> torch.Tensor:
        """A producer's whole update as its slices decode (what aggregation uses), flat in sorted-name order:
        the training check's Δ̂. RemoteProtocolError when a slice is no slice of that round by that producer;
        TransportError or trio.TooSlowError when one cannot be fetched. The slices are released with the round."""
        bounds = compute.slice_bounds(self.round_numel(update.round), self.spec.aggregation_shards)
        if len(update.manifest_ids) != len(bounds):
            raise IntegrityError(f"an update of {len(update.manifest_ids)} slices, not {len(bounds)}")
        deadline_s = self.spec.round_deadline_s * AGGREGATE_FETCH_SHARE
        parts = []
        for s, (a, b) in enumerate(bounds):
            manifest, data = await self._fetch_payload(update.manifest_ids[s], update.producer, b - a, deadline_s,
                                                       kept=self._slices, round_=update.round, codec=self.codec)
            label = f"task/{self.tid[:12]}/r{update.round}/u{s}"
            if manifest.label != label:
                raise IntegrityError(f"{update.manifest_ids[s][:16]} is labelled {manifest.label!r}, not {label!r}")
            parts.append(await trio.to_thread.run_sync(compute.decode_slice, data, b - a, self.codec))
        return torch.cat(parts)

    async def _cancel_when_gone(self, pending: dict[str, trio.CancelScope]) -> None:
        """Cancel each fetch in ``pending`` (by producer) once its producer has been gone PRODUCER_GONE_S; one
        watcher for the whole aggregation, until it is cancelled."""
        gone_since: dict[str, float] = {}
        while True:
            await trio.sleep(GONE_POLL_S)
            now = trio.current_time()
            for peer, scope in list(pending.items()):
                if peer == self.me or not self.gone(peer):
                    gone_since.pop(peer, None)
                elif now - gone_since.setdefault(peer, now) >= PRODUCER_GONE_S:
                    scope.cancel()

    async def verify(self, job: Verify) -> Verified:
        """Recompute an aggregate from exactly the slices it lists (fetched from their producers or any
        holder) and hash it as its aggregator would have. UNDECODABLE when a listed slice is no slice of
        this round by its producer, or the screen over the included and screened slices leaves out others
        than the aggregate says (a proof against the aggregate); None when one could not be fetched, or the
        rule weighs by samples and a listed update was never heard (nothing is decided)."""
        numel, deadline_s = self._slice_numel(job.slice, job.round), self.spec.round_deadline_s * AGGREGATE_FETCH_SHARE
        if self.spec.aggregation.rule == "mean" and any(i.samples is None for i in job.inputs):
            return Verified(key=job.key, result_hash=None)
        label = f"task/{self.tid[:12]}/r{job.round}/u{job.slice}"
        got: dict[str, tuple[object, int]] = {}
        undecodable, missing = [], []

        async def one(item) -> None:
            try:
                manifest, data = await self._fetch_payload(item.manifest_id, item.producer, numel, deadline_s,
                                                           kept=self._slices, round_=job.round, codec=self.codec)
                if manifest.label != label:
                    raise IntegrityError(f"{item.manifest_id[:16]} is labelled {manifest.label!r}, not {label!r}")
                got[item.producer] = (data, item.samples or 1)
            except RemoteProtocolError as exc:
                # Not signed by its producer, another round's or slice's, or not a slice of this size:
                # every node that fetches it finds the same.
                log.info("task %s round %d: an input of slice %d is no slice of this round: %s", self.tid[:12],
                         job.round, job.slice, exc)
                undecodable.append(item.producer)
            except (TransportError, trio.TooSlowError) as exc:
                log.info("task %s round %d: slice %d of %s not fetched to check an aggregate: %s", self.tid[:12],
                         job.round, job.slice, item.producer, str(exc) or "timed out")
                missing.append(item.producer)

        async with trio.open_nursery() as nursery:
            for item in (*job.inputs, *(i for i, _ in job.screened)):
                nursery.start_soon(one, item)
        if undecodable:
            return Verified(key=job.key, result_hash=UNDECODABLE)
        if missing:
            return Verified(key=job.key, result_hash=None)
        started = trio.current_time()
        try:
            return await self._recompute(job, got, numel)
        finally:
            self.verify_compute_s += trio.current_time() - started

    async def _recompute(self, job: Verify, got: dict, numel: int) -> Verified:
        """The verification's own compute, once its inputs are here: combine and hash."""
        if job.screened:
            claimed = {i.producer: why for i, why in job.screened}
            try:
                out = await trio.to_thread.run_sync(robust.combine, got, numel, self.spec.aggregation, self.codec,
                                                self.out)
            except IntegrityError:
                return Verified(key=job.key, result_hash=UNDECODABLE)
            if out.bad or out.screened != claimed or out.data is None:
                log.info("task %s round %d: the screen over slice %d leaves out %s, not %s as its aggregate says",
                         self.tid[:12], job.round, job.slice, out.screened or "nothing", claimed)
                return Verified(key=job.key, result_hash=UNDECODABLE)
            # The screen runs until what it keeps is screened clean, so this is what the included slices alone give.
            data = out.data
        else:
            try:
                # A listed slice that is left out (it does not decode, or the screen drops it) is one no honest
                # aggregator lists.
                data, left_out = await trio.to_thread.run_sync(robust.aggregate_slice, got, numel,
                                                               self.spec.aggregation, self.codec, self.out)
            except IntegrityError:
                left_out = list(got)
            if left_out:
                return Verified(key=job.key, result_hash=UNDECODABLE)
        return Verified(key=job.key, result_hash=hashlib.sha256(
            compute.tensor_bytes(data) if hasattr(data, "data_ptr") else data).hexdigest())

    def _intact(self, manifest: Manifest) -> bool:
        try:
            self.shardcast.load_tensors(manifest, verify=True)
            return True
        except LocalStoreError:
            return False

    async def apply(self, state: compute.OuterState, job: Apply) -> compute.OuterState:
        """θ_{r+1}: the chosen aggregates through the outer step, or θ_r again when the round failed."""
        kept = compute.OuterState(round=state.round + 1, weights=state.weights, outer=state.outer, work=state.work,
                                  hashes=state.hashes)
        if not job.chosen:
            log.warning("task %s round %d failed: %s; keeping the weights", self.tid[:12], job.round, job.reason)
            return kept
        payloads: list = [None] * len(job.chosen)

        async def one(i: int) -> None:
            chosen = job.chosen[i]
            # Every candidate holds the same bytes; one this node banned would not serve them (a fetch from it
            # waits out its timeout), so it is tried last.
            candidates = sorted((chosen, *(job.same[i] if job.same else ())), key=lambda c: self.banned(c.aggregator))
            for candidate in candidates:
                try:
                    manifest, data = await self._fetch_payload(
                        candidate.manifest_id, candidate.aggregator, self._slice_numel(chosen.slice, job.round),
                        self.spec.round_deadline_s, kept=self._aggregates, round_=job.round, codec=self.out)
                    # The store verified every shard on arrival; this checks the aggregator's claim.
                    if payload_hash(manifest, data) != chosen.result_hash:
                        raise IntegrityError("aggregate does not match its announced hash")
                    payloads[i] = data
                    return
                except RemoteProtocolError as exc:
                    self.penalize(candidate.aggregator, "corrupt_shard")
                    log.warning("aggregate from %s rejected: %s", candidate.aggregator, exc)
                except (TransportError, trio.TooSlowError) as exc:
                    log.info("aggregate from %s not fetched: %s", candidate.aggregator, str(exc) or "timed out")

        async with trio.open_nursery() as nursery:
            for i in range(len(job.chosen)):
                nursery.start_soon(one, i)
        if any(p is None for p in payloads):
            # Our weights will differ from the vote's winner; the vote then re-syncs us.
            log.warning("task %s round %d: an aggregate could not be fetched", self.tid[:12], job.round)
            return kept
        part = self.fragment(job.round)
        new = await trio.to_thread.run_sync(lambda: compute.apply_aggregates(
            state, payloads, state.work + round_work(job.chosen), self.out, names=None if part is None else part[0]))
        self._applied[job.round] = payloads
        for old in sorted(self._applied)[:-APPLIED_KEPT]:
            del self._applied[old]
        await self.collect(job.round)
        return new

    def applied_mean(self, round_: int) -> Callable[[], torch.Tensor] | None:
        """The mean update of round ``round_`` as this node applied it, while it is one of the last APPLIED_KEPT
        applied here (None otherwise): a function that decodes it (the whole model, flat; call it in a thread).
        It holds that round's aggregates itself, so a check that took it keeps its reference however many
        rounds are applied before it runs."""
        payloads = self._applied.get(round_)
        if payloads is None:
            return None
        bounds = compute.slice_bounds(self.round_numel(round_), len(payloads))
        return lambda: torch.cat([compute.decode_slice(p, b - a, self.out) for p, (a, b) in zip(payloads, bounds)])

    async def fetch_initial(self, manifest_hex: str) -> dict:
        """The spec's initial weights: a tensors manifest, or a file manifest of a safetensors file.

        Any signer will do: the id pins the manifest, which pins every shard's hash. Safetensors is
        parsed, never executed. Layout checks are the caller's (compute.state_from_initial).
        """
        with trio.fail_after(self.spec.round_deadline_s):
            manifest = await self.shardcast.fetch(bytes.fromhex(manifest_hex))
        if manifest.kind == KIND_TENSORS:
            return await trio.to_thread.run_sync(self.shardcast.load_tensors, manifest)
        limit = 64 * self.num_params() + (1 << 20)
        if manifest.total_bytes > limit:
            raise IntegrityError(f"initial weights file of {manifest.total_bytes} bytes is far larger than the model")
        path = self.dir / "init.safetensors"

        def load() -> dict:
            self.shardcast.export_file(manifest, path)
            try:
                return load_named(path)
            except Exception as exc:  # safetensors raises its own error kinds for a malformed header
                raise IntegrityError(f"initial weights are not a safetensors file: {exc}") from None
        return await trio.to_thread.run_sync(load)

    # -- weights for joiners and dissenters --------------------------------------------------------

    async def fetch_state(self, head: Head, sources: tuple[Head, ...],
                          have: compute.OuterState | None) -> compute.OuterState | None:
        """θ_{head.round} and the outer state from the first source whose bytes match both hashes
        (``have`` itself when it already is those weights, as after a restart)."""
        if have is not None and have.round == head.round and have.weights_hash() == head.weights_hash \
                and have.state_hash() == head.state_hash:
            have.work = head.work
            return have
        for source in sources:
            if not source.state_manifest or source.peer_id == self.me:
                continue
            if (why := await self._not_serving(source.peer_id, source.state_manifest)) is not None:
                # Replaced by newer weights before we asked, or out of reach (a connection that died with a
                # partition and is not yet redialled): failing now, not after the round deadline, lets the task
                # machine take another source or newer weights at once.
                log.info("weights from %s not fetched: %s", source.peer_id, why)
                continue
            try:
                m, tensors = await self._fetch(source.state_manifest, source.peer_id, self.spec.round_deadline_s,
                                               verify=False)
                state = await trio.to_thread.run_sync(lambda: compute.state_from_tensors(
                    self.spec, head.round, tensors, weights_hash_=head.weights_hash, state_hash=head.state_hash,
                    work=head.work))
                # Served from here until our own next state; whatever came before head.round is done with.
                await self._keep_state(manifest_id(m))
                await self.collect(head.round - 1)
                return state
            except RemoteProtocolError as exc:
                self.penalize(source.peer_id, "corrupt_shard")
                log.warning("weights from %s rejected: %s", source.peer_id, exc)
            except (TransportError, trio.TooSlowError) as exc:
                log.info("weights from %s not fetched: %s", source.peer_id, str(exc) or "timed out")
        return None

    async def _not_serving(self, peer: str, manifest_hex: str) -> str | None:
        """Why ``peer`` will not serve a manifest this node does not hold whole (None: it may): it says it holds
        no shard of it, or it does not answer the question at all."""
        mid = bytes.fromhex(manifest_hex)
        if self._held_whole(mid):
            return None
        holds = None
        with trio.move_on_after(self.spec.round_deadline_s * STATE_ASK_SHARE):
            holds = await self.shardcast.holds(peer, mid)
        return None if holds else "it no longer holds them" if holds is False else "it does not answer"

    # -- the dataset -------------------------------------------------------------------------------

    def offer_dataset(self, path: Path) -> None:
        self._offer_path = path

    def on_offer(self, offer: DatasetOffer) -> None:
        if offer.sha256 == self.spec.dataset.sha256 and len(self.offers) < 64 and offer.manifest_id not in self.offers:
            self.offers[offer.manifest_id] = offer
            self._offers_changed.set()
            self._offers_changed = trio.Event()

    async def current_offer(self) -> bytes:
        """Our sealed DatasetOffer, re-published whenever the store let the file's manifest go."""
        if self._offer_path is None:
            return b""
        if not self._offer_id or self.shardcast.store.get_manifest(bytes.fromhex(self._offer_id)) is None:
            m = await self.shardcast.publish_file(self._offer_path, label=f"dataset/{self._offer_path.stem[:16]}")
            self._offer_id = _manifest_hex(m)
            self._offer_sealed = b""
        if not self._offer_sealed:
            self._offer_sealed = seal(DatasetOffer(task_id=self.tid, sha256=self.spec.dataset.sha256,
                                                   manifest_id=self._offer_id), self.keypair)
        return self._offer_sealed

    async def fetch_dataset(self, dest: Path, wait_s: float) -> None:
        """Wait for a peer's offer, fetch the file and keep it only if its sha256 is the spec's."""
        want = self.spec.dataset.sha256
        tried: set[str] = set()
        with trio.move_on_after(wait_s):
            while True:
                for mid in [m for m in self.offers if m not in tried]:
                    tried.add(mid)
                    try:
                        with trio.fail_after(self.spec.round_deadline_s):
                            manifest = await self.shardcast.fetch(bytes.fromhex(mid))
                        if manifest.kind != KIND_FILE or manifest.total_bytes > self.spec.dataset.max_bytes:
                            raise IntegrityError("dataset offer is not a file of the promised size")
                        tmp = dest.with_name(dest.name + f".{os.getpid()}.part")
                        await trio.to_thread.run_sync(self.shardcast.export_file, manifest, tmp)
                        digest = await trio.to_thread.run_sync(lambda: hashlib.sha256(tmp.read_bytes()).hexdigest())
                        if digest != want:
                            tmp.unlink(missing_ok=True)
                            raise IntegrityError("dataset bytes do not match the spec's sha256")
                        os.replace(tmp, dest)
                        return
                    except (RemoteProtocolError, TransportError, trio.TooSlowError) as exc:
                        log.warning("dataset offer %s failed: %s", mid[:16], str(exc) or "timed out")
                await self._offers_changed.wait()
        raise TaskRejected(f"dataset {want[:16]}... differs from this node's stdlib corpus and no peer "
                           f"delivered it within {wait_s:.0f} s")


def _manifest_hex(m: Manifest) -> str:
    return manifest_id(m).hex()


def payload_hash(manifest: Manifest, data) -> str:
    """sha256 of a one-tensor payload (bytes-like or a uint8 tensor). A payload that is exactly one shard has
    that shard's hash, which the store checked where the bytes arrived or were made: no second pass over them."""
    if manifest.num_shards == 1 and manifest.total_bytes == len(data) and len(manifest.tensors) == 1 \
            and manifest.tensors[0].offset == 0:
        return manifest.shard_hashes[0].hex()
    return hashlib.sha256(compute.tensor_bytes(data) if hasattr(data, "data_ptr") else data).hexdigest()

