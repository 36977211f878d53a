"""A task's SHARDCAST traffic: update slices, aggregates, weights and the dataset, each verified on arrival."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from node.tasks import compute
from protocol.errors import IntegrityError, LocalStoreError, RemoteProtocolError, TaskRejected, TransportError
from protocol.envelope import seal
from protocol.manifest import KIND_FILE, KIND_TENSORS, Manifest, manifest_id
from protocol.round import Aggregate, Apply, RoundFailed
from protocol.task import AggregateAnnounce, DatasetOffer, WeightsAnnounce

if TYPE_CHECKING:
    from node.tasks.runner import TaskRunner

log = logging.getLogger("shoal.tasks")


class Exchange:
    def __init__(self, runner: "TaskRunner"):
        self.runner = runner
        self.offers: dict[str, DatasetOffer] = {}
        self._offer_path: Path | None = None
        self._offer_id = ""
        self._offer_sealed = b""

    @property
    def shardcast(self):
        return self.runner.node.shardcast

    # -- fetching with verification ------------------------------------------------------------

    async def _fetch(self, manifest_hex: str, signer: str, timeout_s: float) -> tuple[Manifest, dict]:
        """Fetch a tensors manifest signed by ``signer``; IntegrityError/TransferTimeout on failure."""
        mid = bytes.fromhex(manifest_hex)
        with trio.fail_after(timeout_s):
            manifest = await self.shardcast.fetch(mid)
        stored = self.shardcast.store.get_manifest(mid)
        if stored is None or stored.signer != signer:
            raise IntegrityError(f"manifest {manifest_hex[:16]} is not signed by {signer}")
        if manifest.kind != KIND_TENSORS:
            raise IntegrityError(f"manifest {manifest_hex[:16]} holds a file, not tensors")
        try:
            tensors = await trio.to_thread.run_sync(self.shardcast.load_tensors, manifest)
        except LocalStoreError:
            # Our own disk rotted, not the signer's bytes: the bad shard was dropped, so fetch it again.
            with trio.fail_after(timeout_s):
                manifest = await self.shardcast.fetch(mid)
            tensors = await trio.to_thread.run_sync(self.shardcast.load_tensors, manifest)
        return manifest, tensors

    async def _fetch_payload(self, manifest_hex: str, signer: str, numel: int, timeout_s: float) -> bytes:
        manifest, tensors = await self._fetch(manifest_hex, signer, timeout_s)
        return compute.payload_bytes(manifest, tensors, numel)

    def _slice_numel(self, slice_index: int) -> int:
        n = self.runner.num_params()
        a, b = compute.slice_bounds(n, self.runner.spec.aggregation_shards)[slice_index]
        return b - a

    # -- publishing ------------------------------------------------------------------------------

    async def publish_payload(self, data: bytes, label: str) -> str:
        m = await self.shardcast.publish_tensors(compute.payload_tensor(data), label=label)
        return _manifest_hex(m)

    async def publish_state(self, state: compute.OuterState, label: str) -> str:
        m = await self.shardcast.publish_tensors(state.state_tensors(), label=label)
        return _manifest_hex(m)

    # -- aggregation -----------------------------------------------------------------------------

    async def aggregate(self, job: Aggregate) -> None:
        """Fetch slice ``job.slice`` from every producer, verify, average, publish and announce."""
        runner, numel = self.runner, self._slice_numel(job.slice)
        got: dict[str, tuple[bytes, int]] = {}

        async def one(update) -> None:
            try:
                data = await self._fetch_payload(update.manifest_ids[job.slice], update.producer, numel,
                                                 runner.spec.round_deadline_s)
                compute.decode_slice(data, numel)
                got[update.producer] = (data, update.samples)
            except RemoteProtocolError as exc:
                log.warning("task %s round %d: slice %d from %s rejected: %s", runner.tid[:12], job.round,
                            job.slice, update.producer, exc)
                runner.node.membership.penalize(update.producer, "corrupt_shard")
            except (TransportError, trio.TooSlowError) as exc:
                log.info("task %s round %d: slice %d from %s not fetched: %s", runner.tid[:12], job.round,
                         job.slice, update.producer, exc or "timeout")

        async with trio.open_nursery() as nursery:
            for update in job.updates:
                nursery.start_soon(one, update)
        if not got:
            return
        data, result_hash = await trio.to_thread.run_sync(compute.aggregate, got, numel)
        manifest_id = await self.publish_payload(data, f"task/{runner.tid[:12]}/r{job.round}/a{job.slice}")
        await runner.publish(AggregateAnnounce(
            task_id=runner.tid, round=job.round, slice=job.slice, aggregator=runner.me,
            included=tuple(sorted(got)), manifest_id=manifest_id, result_hash=result_hash))

    async def apply(self, state: compute.OuterState, outcome: Apply | RoundFailed) -> compute.OuterState:
        """θ_{r+1}: the chosen aggregates through the outer step, or θ_r again when the round failed."""
        runner = self.runner
        if isinstance(outcome, RoundFailed):
            log.warning("task %s round %d failed: %s; keeping the weights", runner.tid[:12], outcome.round,
                        outcome.reason)
            return compute.OuterState(round=state.round + 1, weights=state.weights, outer=state.outer)
        payloads: list[bytes | None] = [None] * len(outcome.chosen)

        async def one(i: int, chosen: AggregateAnnounce) -> None:
            rec = runner.machine.rounds.get(outcome.round)
            same = [chosen] + [a for a in (rec.aggregates.get(chosen.slice, {}).values() if rec else ())
                               if a.result_hash == chosen.result_hash and a is not chosen]
            for candidate in same:
                try:
                    data = await self._fetch_payload(candidate.manifest_id, candidate.aggregator,
                                                     self._slice_numel(chosen.slice), runner.spec.round_deadline_s)
                    if hashlib.sha256(data).hexdigest() != chosen.result_hash:
                        raise IntegrityError("aggregate does not match its announced hash")
                    payloads[i] = data
                    return
                except RemoteProtocolError as exc:
                    runner.node.membership.penalize(candidate.aggregator, "corrupt_shard")
                    log.warning("aggregate from %s rejected: %s", candidate.aggregator, exc)
                except (TransportError, trio.TooSlowError) as exc:
                    log.info("aggregate from %s not fetched: %s", candidate.aggregator, exc or "timeout")

        async with trio.open_nursery() as nursery:
            for i, chosen in enumerate(outcome.chosen):
                nursery.start_soon(one, i, chosen)
        if any(p is None for p in payloads):
            # Our weights will differ from the majority's; the weights vote then re-syncs us.
            log.warning("task %s round %d: an aggregate could not be fetched", runner.tid[:12], outcome.round)
            return compute.OuterState(round=state.round + 1, weights=state.weights, outer=state.outer)
        return await trio.to_thread.run_sync(compute.apply_aggregates, state, payloads)

    async def fetch_initial(self, manifest_hex: str) -> dict:
        """The spec's initial weights: a tensors manifest, or a file manifest of a safetensors file.

        Any signer will do: the id pins the manifest, which pins every shard's hash. Safetensors is
        parsed, never executed. Layout checks are the caller's (compute.state_from_initial).
        """
        runner = self.runner
        with trio.fail_after(runner.spec.round_deadline_s):
            manifest = await self.shardcast.fetch(bytes.fromhex(manifest_hex))
        if manifest.kind == KIND_TENSORS:
            return await trio.to_thread.run_sync(self.shardcast.load_tensors, manifest)
        limit = 64 * runner.num_params() + (1 << 20)
        if manifest.total_bytes > limit:
            raise IntegrityError(f"initial weights file of {manifest.total_bytes} bytes is far larger than the model")
        path = runner.dir / "init.safetensors"

        def load() -> dict:
            from node.train.diloco import load_named
            self.shardcast.export_file(manifest, path)
            try:
                return load_named(path)
            except Exception as exc:  # safetensors raises its own error kinds for a malformed header
                raise IntegrityError(f"initial weights are not a safetensors file: {exc}") from None
        return await trio.to_thread.run_sync(load)

    # -- weights for joiners and dissenters --------------------------------------------------------

    async def fetch_state(self, r: int, weights_hash: str, state_hash: str,
                          sources: tuple[WeightsAnnounce, ...]) -> compute.OuterState | None:
        """θ_r and the outer state from the first source that delivers bytes matching both hashes."""
        runner = self.runner
        for source in sources:
            if not source.state_manifest or source.peer_id == runner.me:
                continue
            try:
                _, tensors = await self._fetch(source.state_manifest, source.peer_id, runner.spec.round_deadline_s)
                return await trio.to_thread.run_sync(lambda: compute.state_from_tensors(
                    runner.spec, r, tensors, weights_hash_=weights_hash, state_hash=state_hash))
            except RemoteProtocolError as exc:
                runner.node.membership.penalize(source.peer_id, "corrupt_shard")
                log.warning("weights from %s rejected: %s", source.peer_id, exc)
            except (TransportError, trio.TooSlowError) as exc:
                log.info("weights from %s not fetched: %s", source.peer_id, exc or "timeout")
        return None

    async def sync(self, latest, saved: compute.OuterState | None) -> compute.OuterState | None:
        r, weights_hash, state_hash, sources = latest
        if saved is not None and saved.round == r + 1 and saved.weights_hash() == weights_hash \
                and saved.state_hash() == state_hash:
            return saved
        self.runner.detail = f"fetching the weights after round {r} from {len(sources)} peer(s)"
        state = await self.fetch_state(r + 1, weights_hash, state_hash, sources)
        if state is not None:
            await trio.to_thread.run_sync(compute.save_checkpoint, self.runner.dir, state)
        return state

    # -- the dataset -------------------------------------------------------------------------------

    def offer_dataset(self, path: Path) -> None:
        self._offer_path = path

    def on_offer(self, offer: DatasetOffer) -> None:
        if offer.sha256 == self.runner.spec.dataset.sha256 and len(self.offers) < 64:
            self.offers[offer.manifest_id] = offer

    async def current_offer(self) -> bytes:
        """Our sealed DatasetOffer, re-published whenever the store let the file's manifest go."""
        if self._offer_path is None:
            return b""
        if not self._offer_id or self.shardcast.store.get_manifest(bytes.fromhex(self._offer_id)) is None:
            m = await self.shardcast.publish_file(self._offer_path, label=f"dataset/{self._offer_path.stem[:16]}")
            self._offer_id = _manifest_hex(m)
            self._offer_sealed = b""
        if not self._offer_sealed:
            self._offer_sealed = seal(DatasetOffer(task_id=self.runner.tid, sha256=self.runner.spec.dataset.sha256,
                                                   manifest_id=self._offer_id), self.runner.node.keypair)
        return self._offer_sealed

    async def fetch_dataset(self, dest: Path) -> None:
        """Wait for a peer's offer, fetch the file and keep it only if its sha256 is the spec's."""
        runner = self.runner
        want = runner.spec.dataset.sha256
        tried: set[str] = set()
        with trio.move_on_after(runner.options.dataset_wait_s):
            while True:
                for mid in [m for m in self.offers if m not in tried]:
                    tried.add(mid)
                    try:
                        with trio.fail_after(runner.spec.round_deadline_s):
                            manifest = await self.shardcast.fetch(bytes.fromhex(mid))
                        if manifest.kind != KIND_FILE or manifest.total_bytes > runner.spec.dataset.max_bytes:
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
                        log.warning("dataset offer %s failed: %s", mid[:16], exc or "timeout")
                await runner.wait_changed(0.5)
        raise TaskRejected(f"dataset {want[:16]}... differs from this node's stdlib corpus and no peer "
                           f"delivered it within {runner.options.dataset_wait_s:.0f} s")


def _manifest_hex(m: Manifest) -> str:
    return manifest_id(m).hex()

