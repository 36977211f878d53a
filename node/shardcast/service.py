"""ShardcastService: publish, announce, serve and fetch verified shards between untrusted peers.

Past 500 lines: the serving side (_serve_manifest, _serve_shard, the upload limiter and the
super-seeding choice) shares the holder table and stream-abuse counters with the fetching side;
splitting it into its own module is the next change to this file, not yet made.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable

import trio

from p2p.api import GossipMessage, Host, Stream
from p2p.framing import recv_message, send_message
from protocol.envelope import open_sealed, seal
from protocol.errors import (DecodeError, IntegrityError, LocalStoreError, RemoteProtocolError, TransferTimeout,
                             TransportError)
from protocol.keys import Keypair
from protocol.scores import FloodLimiter
from protocol.manifest import (KIND_FILE, KIND_TENSORS, MAX_HAVES_PER_MESSAGE, MAX_MANIFEST_BYTES, STATUS_BUSY,
                               STATUS_MISSING, STATUS_OK, STATUS_SEEDED, Have, Haves, Manifest, ManifestRequest,
                               ManifestResponse, SignedManifest, bitfield_from_indices, bitfield_indices,
                               make_manifest, open_manifest, seal_manifest)

from node.shardcast import transfer
from node.shardcast.config import ShardcastConfig, ShardcastStatistics
from node.shardcast.fetcher import FetchProgress, FetchState
from node.shardcast.kept import KeptStreams, close_kept
from node.shardcast.seed import Seed
from node.shardcast.store import ShardStore

log = logging.getLogger(__name__)

TOPIC = "shoal/shards/1"
MANIFEST_PROTOCOL = "/shoal/manifest/1"
_RESPONSE_MAX_BYTES = MAX_MANIFEST_BYTES + 64 * 1024
_MAX_HOLDERS_PER_MANIFEST = 4096
HASH_THREADS = 2


def _signed_by(signed: SignedManifest | None, signer: str | None) -> bool:
    return signed is not None and (signer is None or signed.signer == signer)


class ShardcastService:
    """One node's SHARDCAST: construct it, then ``await nursery.start(service.run)``."""

    def __init__(self, host: Host, keypair: Keypair, store: ShardStore, *,
                 penalize: Callable[[str, str], None] | None = None,
                 config: ShardcastConfig | None = None):
        self.host = host
        self.keypair = keypair
        self.store = store
        self.config = config or ShardcastConfig()
        self._penalize = penalize or (lambda peer_id, reason: None)
        self._stats = ShardcastStatistics()
        self._known: OrderedDict[bytes, SignedManifest] = OrderedDict()
        self._holders: OrderedDict[bytes, dict[str, set[int]]] = OrderedDict()
        self._seeds: dict[bytes, Seed] = {}
        self._active_fetches: Counter[bytes] = Counter()
        self._served_at: dict[bytes, float] = {}
        """When a peer last asked for each manifest we hold (its manifest, or a shard of it)."""
        self._releasing: dict[bytes, float] = {}
        """Released, each with the time it goes by at the latest: dropped once no fetch of it (ours or a peer's) is
        under way, or by then (see release())."""
        self._inflight_by_peer: Counter[str] = Counter()
        self._dirty: set[bytes] = set()
        self._quiet: OrderedDict[bytes, None] = OrderedDict()
        """Manifests fetched with announce=False or published unseeded: _have() gives none of them, so no Have of them
        goes out, after a fetch or in a periodic re-announcement (see fetch())."""
        self._announce_wakeup = trio.Event()
        self._changed = trio.Event()
        self._upload_limiter = trio.CapacityLimiter(self.config.max_uploads)
        self._download_limiter = trio.CapacityLimiter(self.config.max_downloads)
        self._gc_lock = trio.Lock()
        self._running = False
        self._have_tokens = float(self.config.have_burst)
        self._have_refilled_at = 0.0
        self._streams_by_peer: Counter[str] = Counter()
        self._idle_by_peer: Counter[str] = Counter()
        """Inbound /shoal/shard/2 streams waiting for their peer's next request."""
        self._kept = KeptStreams(idle_s=self.config.stream_idle_s, max_per_peer=self.config.max_downloads)
        """Our idle /shoal/shard/2 streams to holders, for the next request to each."""
        self._rate_by_peer: dict[str, float] = {}
        self._unknown_requests = FloodLimiter(rate_per_s=self.config.unknown_requests_per_s,
                                              burst=self.config.unknown_request_burst)
        self._gossip_flood = FloodLimiter(rate_per_s=self.config.gossip_per_s, burst=self.config.gossip_burst)

    # lifecycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve shards and manifests, follow the gossip topic, announce holdings; never returns."""
        for protocol in transfer.SHARD_PROTOCOLS:
            self.host.set_stream_handler(protocol, self._serve_shard)
        self.host.set_stream_handler(MANIFEST_PROTOCOL, self._serve_manifest)
        gossip = self.host.subscribe(TOPIC, validator=self._validate_gossip)
        # After a restart, tell the swarm what survived on disk.
        self._dirty.update(self.store.manifest_ids())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._consume_gossip, gossip)
            nursery.start_soon(self._announce_loop)
            nursery.start_soon(self._release_loop)
            nursery.start_soon(self._close_idle_loop)
            self._running = True
            task_status.started()

    def statistics(self) -> ShardcastStatistics:
        s = self._stats
        return replace(s, bytes_served_by_peer=dict(s.bytes_served_by_peer),
                       bytes_fetched_by_peer=dict(s.bytes_fetched_by_peer), shards_rejected=dict(s.shards_rejected),
                       seed_copies_again=dict(s.seed_copies_again),
                       requests_rejected=dict(s.requests_rejected), limits_hit=dict(s.limits_hit))

    def _notify(self) -> None:
        """Wake every fetch waiting for news (a Have, a finished transfer)."""
        self._changed.set()
        self._changed = trio.Event()

    # publishing

    async def publish_tensors(self, tensors, *, label: str = "", version: int | None = None,
                              durable: bool = True, in_memory: bool = False, gossip: bool = True) -> Manifest:
        """Store ``tensors`` (a dict of torch tensors) as shards, sign and announce their manifest. ``in_memory``:
        serve the shards from the tensors' own memory, written nowhere (ShardStore.hold_in_memory); the caller
        then never changes these tensors in place. ``gossip=False``: the manifest is not gossiped, only given to
        whoever asks for it by id (a fetch asks its connected peers): for what is published often and fetched
        rarely, where the manifest (a line per tensor) would go to every peer each time for nothing."""
        from node.shardcast.tensors import TensorParts  # torch only where tensors are used
        parts = await trio.to_thread.run_sync(TensorParts, tensors)
        return await self._publish_parts(parts.pieces, parts.total_bytes, parts.entries, label=label,
                                         version=version, durable=durable, keep=parts if in_memory else None,
                                         gossip=gossip)

    async def publish_blob(self, blob: bytearray, entries, *, label: str = "", version: int | None = None,
                           durable: bool = True, seed: bool = True) -> Manifest:
        """publish_tensors for tensors already laid out in ``blob`` (protocol.manifest.layout_tensors): no copy.
        Each shard is hashed once, side by side in threads; ``durable``: see ShardStore.put_shard. ``seed=False``:
        every asker is served, none sent to the swarm (data for a few peers that fetch it quietly: see fetch())."""
        view = memoryview(blob)
        return await self._publish_parts(lambda start, end: [view[start:end]], len(view), entries, label=label,
                                         version=version, durable=durable, seed=seed)

    async def _publish_parts(self, pieces: Callable[[int, int], list], total_bytes: int, entries, *, label: str,
                             version: int | None, durable: bool, keep: object = None, seed: bool = True,
                             gossip: bool = True) -> Manifest:
        """A tensors manifest over bytes read as ``pieces(start, end)``: each shard hashed once (shards side by
        side in threads), then written with that hash, or, with ``keep`` (what owns the memory the pieces view),
        held in memory and the manifest not written either."""
        cfg = self.config

        def shard_hash(bounds: tuple[int, int]) -> bytes:
            h = hashlib.sha256()
            for piece in pieces(*bounds):
                h.update(piece)
            return h.digest()

        def work() -> SignedManifest:
            ranges = [(a, min(total_bytes, a + cfg.shard_bytes)) for a in range(0, total_bytes, cfg.shard_bytes)]
            with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
                hashes = list(pool.map(shard_hash, ranges))
            m = make_manifest(kind=KIND_TENSORS, label=label, version=self._version(version), total_bytes=total_bytes,
                              shard_bytes=cfg.shard_bytes, shard_hashes=hashes, tensors=tuple(entries))
            for bounds, sha in zip(ranges, hashes):
                if keep is not None:
                    self.store.hold_in_memory(pieces(*bounds), sha, keep=keep)
                else:
                    self.store.put_shard_pieces(pieces(*bounds), sha, durable=durable)
            return self._sign_and_store(m, persist=keep is None)

        return await self._publish(work, seed=seed, gossip=gossip)

    async def publish_file(self, path: Path | str, *, label: str | None = None,
                           version: int | None = None) -> Manifest:
        """Store a file (a safetensors file, or any file) as shards; sign and announce its manifest."""
        path = Path(path)
        cfg = self.config

        def work() -> SignedManifest:
            hashes = []
            total = 0
            with open(path, "rb") as f:
                while chunk := f.read(cfg.shard_bytes):
                    hashes.append(self.store.put_shard(chunk))
                    total += len(chunk)
            m = make_manifest(kind=KIND_FILE, label=path.name if label is None else label,
                              version=self._version(version), total_bytes=total, shard_bytes=cfg.shard_bytes,
                              shard_hashes=hashes)
            return self._sign_and_store(m)

        return await self._publish(work)

    def _version(self, version: int | None) -> int:
        return time.time_ns() // 1000 if version is None else version

    def _sign_and_store(self, m: Manifest, *, persist: bool = True) -> SignedManifest:
        signed = seal_manifest(m, self.keypair)
        self.store.put_manifest(signed, persist=persist)
        return signed

    async def _publish(self, work, *, seed: bool = True, gossip: bool = True) -> Manifest:
        assert self._running, "start the service with nursery.start(service.run) first"
        # The GC lock keeps freshly written shards from being collected before their manifest exists.
        async with self._gc_lock:
            signed = await trio.to_thread.run_sync(work)
        if not seed:
            self._keep_quiet(signed.manifest_id)  # its few askers know where it is: no Haves, not even periodic ones
        elif not self.config.single_source:
            # Nobody else will ever serve in single-source mode: serve-once would only stall receivers.
            self._seeds[signed.manifest_id] = Seed(num_shards=signed.manifest.num_shards,
                                                   reseed_after_s=self.config.reseed_after_s)
        self._remember(signed)
        # The manifest, gossiped by its signer, is its signer's Have of every shard (_consume_gossip): no Have of
        # our own follows it. The periodic re-announcement still covers it for peers that missed the manifest.
        if gossip:
            await self._gossip(signed.sealed)
        await self._gc()
        return signed.manifest

    # reading back

    def load_tensors(self, manifest: Manifest, *, verify: bool = True) -> dict:
        """The manifest's tensors as CPU tensors sharing one buffer; re-verifies every shard (blocking).

        LocalStoreError if a stored shard no longer matches its hash: our disk's fault, not the
        producer's. The shard is dropped, so fetching the manifest again repairs it. ``verify=False``
        for bytes hashed moments ago where they arrived or were made (the one-way path hashes once each).
        """
        from node.shardcast.tensors import blob_to_tensors
        if manifest.kind != KIND_TENSORS:
            raise ValueError(f"manifest {manifest.label!r} holds a file, not tensors: use export_file")
        return blob_to_tensors(self._assemble(manifest, verify=verify), manifest.tensors)

    async def release(self, manifest_ids, *, hold_s: float | None = None) -> None:
        """Drop these manifests and the shards only they referenced: now, or, while we fetch one or a peer has
        asked for it within serving_grace_s, once that is over (_release_loop), and ``hold_s`` (default
        max_release_hold_s) after this call at the latest, however often peers ask."""
        now, grace = trio.current_time(), self.config.serving_grace_s
        by = now + (self.config.max_release_hold_s if hold_s is None else hold_s)
        self._served_at = {m: t for m, t in self._served_at.items() if now - t < grace}
        async with self._gc_lock:
            wanted = {**{m: by for m in manifest_ids}, **self._releasing}
            self._releasing = {m: t for m, t in wanted.items()
                               if m in self._active_fetches or (m in self._served_at and now < t)}
            protect = set(self._active_fetches) | self._releasing.keys()
            drop = wanted.keys() - self._releasing.keys()
            await trio.to_thread.run_sync(lambda: self.store.gc(keep_manifests=self.config.keep_manifests,
                                                                protect=protect, drop=drop))
        for mid in [m for m in self._seeds if self.store.get_manifest(m) is None]:
            del self._seeds[mid]

    def releasing(self) -> frozenset[bytes]:
        """Manifests released but still kept for a fetch under way."""
        return frozenset(self._releasing)

    async def shard_stream(self, peer: str, *, fresh: bool = False) -> tuple[Stream, bool]:
        """A stream to ask ``peer`` for a shard on, and whether it is a kept one: an idle /shoal/shard/2 stream to it
        unless ``fresh``, else a new stream (/2, or /1 for a peer that serves only that)."""
        if not fresh and (stream := self._kept.take(peer, trio.current_time())) is not None:
            self._stats.streams_reused += 1
            return stream, True
        with trio.fail_after(self.config.stream_open_timeout_s):
            return await self.host.open_stream(peer, transfer.SHARD_PROTOCOLS), False

    async def done_with_shard_stream(self, peer: str, stream: Stream) -> None:
        """After a completed exchange: keep a /shoal/shard/2 stream for the next request to ``peer``, or close it."""
        if not transfer.keeps_open(stream):
            return  # /1: fetch_shard closed it
        if not self._kept.keep(peer, stream, trio.current_time()):
            await close_kept(stream)

    async def _close_idle_loop(self) -> None:
        while True:
            await trio.sleep(self.config.stream_idle_s / 2)
            for stream in self._kept.expired(trio.current_time()):
                await close_kept(stream)

    async def _release_loop(self) -> None:
        while True:
            await trio.sleep(self.config.serving_grace_s / 4)
            if self._releasing:
                await self.release(())

    def _serving(self, manifest_id: bytes) -> None:
        self._served_at[manifest_id] = trio.current_time()

    def export_file(self, manifest: Manifest, path: Path | str) -> None:
        """Write the manifest's content to ``path`` atomically (blocking)."""
        import os
        path = Path(path)
        tmp = path.with_name(f".{path.name}.shardcast.tmp")
        with open(tmp, "wb") as f:
            for h in manifest.shard_hashes:
                f.write(self._read_local(h))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _assemble(self, manifest: Manifest, *, verify: bool = True) -> bytearray:
        blob = bytearray(manifest.total_bytes)
        view = memoryview(blob)
        for i, h in enumerate(manifest.shard_hashes):
            start, end = manifest.shard_range(i)
            try:
                self.store.read_shard_into(h, view[start:end], verify=verify)
            except IntegrityError as exc:
                self._stats.local_corruptions += 1
                log.warning("shardcast: %s", exc)
                raise LocalStoreError(f"{exc}; fetch the manifest again to repair it") from None
            except FileNotFoundError:
                raise LocalStoreError(f"shard {h.hex()[:16]} is gone from the store; fetch it again") from None
        return blob

    def _read_local(self, sha256: bytes) -> bytes:
        try:
            return self.store.read_shard(sha256)
        except IntegrityError as exc:
            self._stats.local_corruptions += 1
            log.warning("shardcast: %s", exc)
            raise LocalStoreError(f"{exc}; fetch the manifest again to repair it") from None

    # fetching

    async def fetch(self, manifest_id: bytes, *, signer: str | None = None, announce: bool = True,
                    progress: Callable[[FetchProgress], None] | None = None) -> Manifest:
        """Fetch every shard of a manifest from whoever holds them; returns it once all are verified on disk.

        ``signer``: only that peer's signature of the manifest will do. A manifest's id covers its content, not
        who signed it, so anyone can sign a copy of another's manifest and answer queries with it; the store
        then keeps the named signer's (the shards are the same).
        ``announce=False``: no Have of this manifest leaves this node (it still serves what it holds, and answers
        queries): for data only a few known peers fetch, who learn its holders from elsewhere (a task's update
        slices, fetched by their aggregators from the producer), where each Have would be gossiped to everyone.
        TransferTimeout if the manifest cannot be found, or no shard arrives for stall_timeout_s.
        """
        assert self._running, "start the service with nursery.start(service.run) first"
        self._active_fetches[manifest_id] += 1
        try:
            signed = await self._resolve_manifest(manifest_id, signer)
            held = self.store.get_manifest(manifest_id)
            if held is None or held.signer != self.keypair.peer_id:
                # Our own signature of a manifest we published stays what we serve, whoever else signed a copy.
                await trio.to_thread.run_sync(self.store.put_manifest, signed)
            if not announce:
                self._keep_quiet(manifest_id)
            else:
                self._quiet.pop(manifest_id, None)
            state = FetchState(self, signed, progress)
            await state.run()
            self._stats.last_fetch_bytes_per_s = state.bytes_per_s()
        finally:
            self._active_fetches[manifest_id] -= 1
            if not self._active_fetches[manifest_id]:
                del self._active_fetches[manifest_id]
        self._mark_dirty(manifest_id)
        await self._gc()
        return signed.manifest

    async def _resolve_manifest(self, manifest_id: bytes, signer: str | None = None) -> SignedManifest:
        deadline = trio.current_time() + self.config.stall_timeout_s
        while True:
            for signed in (self.store.get_manifest(manifest_id), self._known.get(manifest_id)):
                if _signed_by(signed, signer):
                    return signed
            if trio.current_time() >= deadline:
                by = "" if signer is None else f" signed by {signer}"
                raise TransferTimeout(f"manifest {manifest_id.hex()[:16]}{by} not found on any connected peer")
            changed = self._changed
            await self.query_peers(manifest_id, signer)
            if _signed_by(self._known.get(manifest_id), signer):
                continue
            with trio.move_on_after(self.config.query_interval_s):
                await changed.wait()

    async def query_peers(self, manifest_id: bytes, signer: str | None = None) -> None:
        """Ask every connected peer for the manifest (``signer``'s, if named) and its bitfield, in parallel, each
        bounded."""
        async with trio.open_nursery() as nursery:
            for peer in self.host.connected_peers():
                nursery.start_soon(self._query_one, peer, manifest_id, signer)

    async def holds(self, peer: str, manifest_id: bytes) -> bool | None:
        """Whether ``peer`` says it holds any shard of the manifest; None when it did not answer. One query: a
        caller that would otherwise wait out stall_timeout_s for what its only source has released asks first."""
        resp = await self._query_one(peer, manifest_id)
        return None if resp is None else bool(resp.bitfield)

    async def _query_one(self, peer: str, manifest_id: bytes, signer: str | None = None) -> ManifestResponse | None:
        """Ask ``peer`` for the manifest and its bitfield, and remember what it said; its answer (None: none)."""
        cfg = self.config
        try:
            with trio.fail_after(cfg.stream_open_timeout_s + 2 * cfg.inactivity_s):
                stream = await self.host.open_stream(peer, MANIFEST_PROTOCOL)
                try:
                    await send_message(stream, ManifestRequest(manifest_id=manifest_id))
                    await stream.close_write()
                    resp = await recv_message(stream, _RESPONSE_MAX_BYTES, expect=ManifestResponse)
                    await stream.close()
                except BaseException:
                    await transfer.abort(stream)
                    raise
        except (TransportError, trio.TooSlowError):
            return None
        except RemoteProtocolError as exc:
            self._reject(peer, "protocol", exc)
            return None
        if resp is None:
            return None
        try:
            if resp.sealed_manifest and not _signed_by(self._known.get(manifest_id), signer):
                opened = open_manifest(resp.sealed_manifest, expected_id=manifest_id)
                if _signed_by(opened, signer):
                    self._remember(opened)
            signed = self._known.get(manifest_id) or self.store.get_manifest(manifest_id)
            if resp.bitfield and signed is not None:
                n = signed.manifest.num_shards
                if len(resp.bitfield) != (n + 7) // 8:
                    raise DecodeError("bitfield length does not match the manifest")
                self._record_holder(manifest_id, peer, bitfield_indices(resp.bitfield, n))
        except RemoteProtocolError as exc:
            self._reject(peer, "protocol", exc)
            return None
        return resp

    def _reject(self, peer: str, reason: str, exc: BaseException) -> None:
        log.info("shardcast: rejected %s from %s: %s", reason, peer, exc)
        self._stats.shards_rejected[reason] = self._stats.shards_rejected.get(reason, 0) + 1
        self._penalize(peer, reason)

    def _refuse_request(self, peer: str, reason: str, detail: object, *, charge: bool = True) -> None:
        """Count an inbound stream we refused and, when the peer is to blame, charge it ``shard_<reason>``."""
        log.debug("shardcast: refused a stream from %s (%s): %s", peer, reason, detail)
        rejected = self._stats.requests_rejected
        rejected[reason] = rejected.get(reason, 0) + 1
        if charge:
            self._penalize(peer, f"shard_{reason}")

    def _hit_limit(self, limit: str) -> None:
        self._stats.limits_hit[limit] = self._stats.limits_hit.get(limit, 0) + 1

    # availability

    def _remember(self, signed: SignedManifest) -> None:
        self._known[signed.manifest_id] = signed
        self._known.move_to_end(signed.manifest_id)
        while len(self._known) > self.config.max_known_manifests:
            self._known.popitem(last=False)
            self._hit_limit("known_manifests")
        self._notify()

    def _record_holder(self, manifest_id: bytes, peer: str, indices: set[int]) -> None:
        if peer == self.host.peer_id:
            return
        holders = self._holders.get(manifest_id)
        if holders is None:
            if not self._is_known(manifest_id):
                self._make_room_for_unknown_haves()
            holders = self._holders[manifest_id] = {}
            while len(self._holders) > self.config.max_known_manifests:
                oldest = next(iter(self._holders))
                if oldest in self._active_fetches:
                    self._holders.move_to_end(oldest)
                    break
                del self._holders[oldest]
                self._hit_limit("holders")
        if peer in holders or len(holders) < _MAX_HOLDERS_PER_MANIFEST:
            holders[peer] = indices
        else:
            self._hit_limit("holders")
        if (seed := self._seeds.get(manifest_id)) is not None:
            seed.heard(peer, indices, trio.current_time())
        self._notify()

    def _is_known(self, manifest_id: bytes) -> bool:
        return manifest_id in self._known or self.store.get_manifest(manifest_id) is not None

    def _make_room_for_unknown_haves(self) -> None:
        """Haves may precede their manifest, but invented manifest ids must not evict real holders."""
        unknown = [m for m in self._holders if not self._is_known(m) and m not in self._active_fetches]
        if len(unknown) >= self.config.max_unknown_have_manifests:
            self._hit_limit("unknown_have_manifests")
            del self._holders[unknown[0]]

    def record_rate(self, peer: str, nbytes: int, seconds: float) -> None:
        """Fold one verified shard's download rate from ``peer`` into its moving average."""
        rate = nbytes / max(seconds, 1e-3)
        old = self._rate_by_peer.get(peer)
        self._rate_by_peer[peer] = rate if old is None else 0.7 * old + 0.3 * rate
        while len(self._rate_by_peer) > 4 * self.config.max_known_manifests + 256:
            del self._rate_by_peer[next(iter(self._rate_by_peer))]

    def expected_finish_s(self, peer: str) -> float:
        """How soon one more shard from ``peer`` should arrive, relative to other peers: its queue over its rate.

        A peer not measured yet counts as fast as the fastest one, so every holder gets tried.
        """
        fastest = max(self._rate_by_peer.values(), default=1.0)
        return (self._inflight_by_peer[peer] + 1) / self._rate_by_peer.get(peer, fastest)

    def _others_hold(self, manifest_id: bytes, index: int, requester: str) -> bool:
        connected = set(self.host.connected_peers())
        return any(index in held for peer, held in self.holders(manifest_id).items()
                   if peer != requester and peer in connected)

    def holders(self, manifest_id: bytes) -> dict[str, set[int]]:
        return self._holders.get(manifest_id, {})

    def forget_holding(self, manifest_id: bytes, peer: str, index: int) -> None:
        self._holders.get(manifest_id, {}).get(peer, set()).discard(index)

    def _keep_quiet(self, manifest_id: bytes) -> None:
        self._quiet[manifest_id] = None
        self._quiet.move_to_end(manifest_id)
        while len(self._quiet) > self.config.max_known_manifests:
            self._quiet.popitem(last=False)

    def _mark_dirty(self, manifest_id: bytes) -> None:
        self._dirty.add(manifest_id)
        self._announce_wakeup.set()

    async def _announce_loop(self) -> None:
        cfg = self.config
        next_full = trio.current_time() + cfg.reannounce_interval_s
        while True:
            with trio.move_on_at(next_full):
                await self._announce_wakeup.wait()
            self._announce_wakeup = trio.Event()
            if trio.current_time() >= next_full:
                next_full = trio.current_time() + cfg.reannounce_interval_s
                self._dirty.update(self.store.manifest_ids()[-cfg.reannounce_manifests:])
            dirty, self._dirty = self._dirty, set()
            haves = [have for mid in dirty if (have := self._have(mid)) is not None]
            for start in range(0, len(haves), MAX_HAVES_PER_MESSAGE):
                await self._take_have_token()
                await self._gossip(seal(Haves(haves=tuple(haves[start:start + MAX_HAVES_PER_MESSAGE])), self.keypair))
            await trio.sleep(cfg.have_interval_s)

    async def _take_have_token(self) -> None:
        cfg = self.config
        now = trio.current_time()
        self._have_tokens = min(float(cfg.have_burst), self._have_tokens + (now - self._have_refilled_at) * cfg.max_haves_per_s)
        self._have_refilled_at = now
        if self._have_tokens < 1.0:
            await trio.sleep((1.0 - self._have_tokens) / cfg.max_haves_per_s)
            self._have_tokens, self._have_refilled_at = 1.0, trio.current_time()
        self._have_tokens -= 1.0

    def _have(self, manifest_id: bytes) -> Have | None:
        """What we hold of a stored manifest, verified; None if nothing (or the manifest is gone, or quiet)."""
        signed = self.store.get_manifest(manifest_id)
        if signed is None or manifest_id in self._quiet:
            return None
        n = signed.manifest.num_shards
        held = self.store.held_indices(manifest_id)
        return Have(manifest_id=manifest_id, num_shards=n, bitfield=bitfield_from_indices(n, held)) if held else None

    async def _gossip(self, data: bytes) -> None:
        try:
            await self.host.publish(TOPIC, data)
        except TransportError as exc:
            log.warning("shardcast: gossip publish failed: %s", exc)

    def _validate_gossip(self, msg: GossipMessage) -> bool:
        if not self._gossip_flood.allow(msg.origin, trio.current_time()):
            self._hit_limit("gossip_flood")
            self._penalize(msg.origin, "shard_gossip_flood")
            return False
        try:
            signed = open_sealed(msg.data, expect=(Manifest, Have, Haves))
        except RemoteProtocolError:
            self._stats.gossip_rejected += 1
            self._penalize(msg.origin, "shard_gossip_garbage")
            return False
        # A Have speaks for its signer only: a relayed copy must still come from that signer's publish.
        if isinstance(signed.message, (Have, Haves)) and signed.signer != msg.origin:
            self._stats.gossip_rejected += 1
            self._penalize(msg.origin, "impersonation")
            return False
        return True

    async def _consume_gossip(self, gossip: trio.MemoryReceiveChannel[GossipMessage]) -> None:
        async for msg in gossip:
            try:
                signed = open_sealed(msg.data, expect=(Manifest, Have, Haves))
            except RemoteProtocolError:
                self._stats.gossip_rejected += 1
                continue
            if isinstance(signed.message, Manifest):
                manifest = open_manifest(msg.data)
                self._remember(manifest)
                if manifest.signer == msg.origin:
                    # Gossiped by its signer, who published it: it holds every shard (a manifest relayed for
                    # another signer says nothing about who holds what).
                    self._record_holder(manifest.manifest_id, msg.origin, set(range(manifest.manifest.num_shards)))
                continue
            for have in signed.message.haves if isinstance(signed.message, Haves) else (signed.message,):
                known = self._known.get(have.manifest_id) or self.store.get_manifest(have.manifest_id)
                if known is not None and known.manifest.num_shards != have.num_shards:
                    self._stats.gossip_rejected += 1
                    continue
                self._record_holder(have.manifest_id, signed.signer, bitfield_indices(have.bitfield, have.num_shards))

    # serving

    @contextlib.contextmanager
    def _admit(self, peer: str):
        """Count an inbound stream against the per-peer and total caps; yields whether it may proceed."""
        cfg = self.config
        if self._streams_by_peer[peer] >= cfg.max_streams_per_peer:
            self._refuse_request(peer, "too_many_streams", f"{cfg.max_streams_per_peer} already open")
            yield False
            return
        if self._streams_by_peer.total() >= cfg.max_streams:
            self._hit_limit("streams_total")
            self._refuse_request(peer, "busy", f"{cfg.max_streams} streams open", charge=False)
            yield False
            return
        self._streams_by_peer[peer] += 1
        try:
            yield True
        finally:
            self._streams_by_peer[peer] -= 1
            if not self._streams_by_peer[peer]:
                del self._streams_by_peer[peer]

    def _allow_unknown(self, peer: str) -> bool:
        """False (and the peer charged) once it asks for things we do not hold faster than any honest peer."""
        if self._unknown_requests.allow(peer, trio.current_time()):
            return True
        self._refuse_request(peer, "unknown_flood", "too many requests for unknown manifests or shards")
        return False

    async def _serve_manifest(self, stream: Stream) -> None:
        peer = stream.remote_peer
        with self._admit(peer) as admitted:
            if not admitted:
                await transfer.abort(stream)
                return
            try:
                req = await transfer.read_control(stream, self.config.deadlines(), 1024, ManifestRequest)
            except transfer.Refused as exc:
                self._refuse_request(peer, exc.reason, exc, charge=exc.charge)
                await transfer.abort(stream)
                return
            signed = self.store.get_manifest(req.manifest_id) or self._known.get(req.manifest_id)
            held = self.store.held_indices(req.manifest_id)
            if signed is None and not self._allow_unknown(peer):
                await transfer.abort(stream)
                return
            n = signed.manifest.num_shards if signed else 0
            if held:
                self._serving(req.manifest_id)
            try:
                with trio.fail_after(self.config.inactivity_s):
                    await send_message(stream, ManifestResponse(
                        sealed_manifest=signed.sealed if signed else b"",
                        bitfield=bitfield_from_indices(n, held) if held else b""))
                    await stream.close()
            except trio.TooSlowError:
                self._refuse_request(peer, "stalled", "did not read the manifest response")
                await transfer.abort(stream)
            except TransportError as exc:
                log.debug("shardcast: manifest response to %s failed: %s", peer, exc)
                await transfer.abort(stream)

    async def _serve_shard(self, stream: Stream) -> None:
        """One exchange on /shoal/shard/1; on /2, exchanges until the peer closes the stream or leaves it idle.

        A stream counts against the per-peer stream cap while it waits for its first request and during each
        exchange; between exchanges it counts only as idle (max_idle_streams_per_peer), so a fetcher's kept
        streams never crowd out its transfers and queries."""
        peer = stream.remote_peer
        cfg = self.config
        req = None
        while True:
            with self._admit(peer) as admitted:
                if not admitted:
                    await transfer.abort(stream)
                    return
                try:
                    if req is None:
                        req = await transfer.read_request(stream, cfg.deadlines())
                except transfer.Refused as exc:
                    self._refuse_request(peer, exc.reason, exc, charge=exc.charge)
                    await transfer.abort(stream)
                    return
                if not await self._answer_shard(stream, peer, req) or not transfer.keeps_open(stream):
                    return
            if (self._idle_by_peer[peer] >= cfg.max_idle_streams_per_peer
                    or self._idle_by_peer.total() >= cfg.max_streams):
                await close_kept(stream)
                return
            self._idle_by_peer[peer] += 1
            try:
                req = await transfer.read_next_request(stream, 2 * cfg.stream_idle_s)
            except transfer.Refused as exc:
                self._refuse_request(peer, exc.reason, exc, charge=exc.charge)
                await transfer.abort(stream)
                return
            finally:
                self._idle_by_peer[peer] -= 1
                if not self._idle_by_peer[peer]:
                    del self._idle_by_peer[peer]
            if req is None:
                await close_kept(stream)
                return

    async def _answer_shard(self, stream: Stream, peer: str, req) -> bool:
        """Answer one request; returns whether the stream is still open for another (on /shoal/shard/2)."""
        cfg = self.config
        signed = self.store.get_manifest(req.manifest_id)
        m = signed.manifest if signed else None
        if m is None or req.index >= m.num_shards or not self.store.has_shard(m.shard_hashes[req.index]):
            if self._allow_unknown(peer):
                return await transfer.refuse(stream, req, STATUS_MISSING, cfg.deadlines())
            await transfer.abort(stream)
            return False
        seed = self._seeds.get(req.manifest_id)
        if seed is not None and seed.decide(req.index, fallback=req.fallback, now=trio.current_time(),
                                            others_hold=self._others_hold(req.manifest_id, req.index, peer)) != STATUS_OK:
            self._stats.uploads_refused_seeded += 1
            return await transfer.refuse(stream, req, STATUS_SEEDED, cfg.deadlines())
        try:
            self._upload_limiter.acquire_nowait()
        except trio.WouldBlock:
            self._stats.uploads_refused_busy += 1
            return await transfer.refuse(stream, req, STATUS_BUSY, cfg.deadlines())
        sha = m.shard_hashes[req.index]
        self._serving(req.manifest_id)
        stats = self._stats
        if seed is not None and seed.reason != "first":
            stats.seed_copies_again[seed.reason] = stats.seed_copies_again.get(seed.reason, 0) + 1
        stats.uploads_active += 1
        started = seed.begin(req.index, trio.current_time()) if seed is not None else 0.0
        acked = False
        reusable = False

        def count(nbytes: int) -> None:
            stats.bytes_served += nbytes
            stats.bytes_served_by_peer[peer] = stats.bytes_served_by_peer.get(peer, 0) + nbytes

        try:
            # A shard held in memory is sent from there; ``source`` keeps that memory alive for the whole send.
            source = self.store.held_in_memory(sha) or self.store.shard_path(sha)
            result = await transfer.send_shard(stream, req, source=source, sha256=sha,
                                               nbytes=m.shard_size(req.index), deadlines=cfg.upload_deadlines(),
                                               on_bytes=count)
            if result.disk_corrupt:
                # Our disk, not the receiver that told us: count it locally and charge nobody.
                stats.local_corruptions += 1
                log.warning("shardcast: shard %s was corrupt on disk; dropped", sha.hex()[:16])
                self.store.drop_shard(sha)
            elif result.ok:
                stats.shards_served += 1
                acked = True
                reusable = True
        except TransferTimeout as exc:
            # A receiver that stopped reading is charged; one on a slow link (below min_rate) is only counted.
            stats.upload_failures += 1
            self._refuse_request(peer, "stalled" if isinstance(exc, transfer.Stalled) else "slow", exc,
                                 charge=isinstance(exc, transfer.Stalled))
        except (RemoteProtocolError, TransportError, OSError) as exc:
            stats.upload_failures += 1
            log.debug("shardcast: upload of shard %d to %s failed: %s", req.index, peer, exc)
        finally:
            stats.uploads_active -= 1
            self._upload_limiter.release()
            self._serving(req.manifest_id)
            if seed is not None:
                seed.end(req.index, started, trio.current_time(), ok=acked, peer=peer)
        return reusable

    # housekeeping

    async def _gc(self) -> None:
        async with self._gc_lock:
            protect = set(self._active_fetches) | self._releasing.keys()
            await trio.to_thread.run_sync(
                lambda: self.store.gc(keep_manifests=self.config.keep_manifests, protect=protect))
        # Seeding bookkeeping only matters while the manifest is still stored.
        for mid in [m for m in self._seeds if self.store.get_manifest(m) is None]:
            del self._seeds[mid]
