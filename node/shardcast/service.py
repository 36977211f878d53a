"""ShardcastService: publish, announce and fetch verified shards between untrusted peers; serving.py serves them.

Past 500 lines: publishing, the holder table, the Haves and fetching share the known manifests, the holders,
the seeds and the GC lock, and each changes them as the others read them; fetcher.py holds one fetch's choices.
"""

from __future__ import annotations

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
from protocol.envelope import open_sealed
from protocol.errors import (DecodeError, IntegrityError, LocalStoreError, RemoteProtocolError, TransferTimeout,
                             TransportError)
from protocol.keys import Keypair
from protocol.scores import FloodLimiter
from protocol.manifest import (KIND_FILE, KIND_TENSORS, MAX_HAVES_PER_MESSAGE, MAX_MANIFEST_BYTES, Have, Haves,
                               Manifest, ManifestRequest, ManifestResponse, SignedManifest, bitfield_from_indices,
                               bitfield_indices, make_manifest, open_manifest, seal_manifest)

from node.shardcast import transfer
from node.shardcast.config import ShardcastConfig, ShardcastStatistics
from node.shardcast.fetcher import FetchProgress, FetchState
from node.shardcast.haves import HaveStreams
from node.shardcast.incoming import IncomingShards
from node.shardcast.kept import KeptStreams, close_kept
from node.shardcast.seed import Seed
from node.shardcast.serving import MANIFEST_PROTOCOL, ShardServer
from node.shardcast.store import ShardStore

log = logging.getLogger(__name__)

TOPIC = "shoal/shards/1"
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
        self._arriving: dict[bytes, dict[str, set[int]]] = {}
        """Of the peers in _holders, the shards each announced as on their way to it (passed on as they arrive)."""
        self._seeds: dict[bytes, Seed] = {}
        self._active_fetches: Counter[bytes] = Counter()
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
        self._download_limiter = trio.CapacityLimiter(self.config.max_downloads)
        self._gc_lock = trio.Lock()
        self._running = False
        self._have_tokens = float(self.config.have_burst)
        self._have_refilled_at = 0.0
        self._kept = KeptStreams(idle_s=self.config.stream_idle_s, max_per_peer=self.config.max_downloads)
        """Our idle /shoal/shard/2 streams to holders, for the next request to each."""
        self._rate_by_peer: dict[str, float] = {}
        self._gossip_flood = FloodLimiter(rate_per_s=self.config.gossip_per_s, burst=self.config.gossip_burst)
        self.incoming = IncomingShards(on_change=self._mark_dirty)
        self.server = ShardServer(store=store, config=self.config, stats=self._stats, seeds=self._seeds,
                                  penalize=self._penalize, lookup=self._lookup, others_hold=self._others_hold,
                                  on_haves=self._on_haves, incoming=self.incoming)
        self._have_streams = HaveStreams(host, self._stats, timeout_s=self.config.have_timeout_s,
                                         retry_after_s=self.config.reannounce_interval_s)

    # lifecycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve shards and manifests, follow the gossip topic, announce holdings; never returns."""
        self.server.register(self.host)
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
        self.server.forget_served_before(now - grace)
        async with self._gc_lock:
            wanted = {**{m: by for m in manifest_ids}, **self._releasing}
            self._releasing = {m: t for m, t in wanted.items()
                               if m in self._active_fetches or (m in self.server.served_at and now < t)}
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

    # availability

    def _remember(self, signed: SignedManifest) -> None:
        self._known[signed.manifest_id] = signed
        self._known.move_to_end(signed.manifest_id)
        while len(self._known) > self.config.max_known_manifests:
            self._known.popitem(last=False)
            self._stats.hit_limit("known_manifests")
        self._notify()

    def _record_holder(self, manifest_id: bytes, peer: str, indices: set[int], arriving: set[int] = frozenset()) -> None:
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
                self._arriving.pop(oldest, None)
                self._stats.hit_limit("holders")
        if peer in holders or len(holders) < _MAX_HOLDERS_PER_MANIFEST:
            holders[peer] = indices
            if arriving:
                self._arriving.setdefault(manifest_id, {})[peer] = set(arriving) - indices
            elif manifest_id in self._arriving:
                self._arriving[manifest_id].pop(peer, None)
        else:
            self._stats.hit_limit("holders")
        if (seed := self._seeds.get(manifest_id)) is not None:
            seed.heard(peer, indices, trio.current_time())
        self._notify()

    def _is_known(self, manifest_id: bytes) -> bool:
        return manifest_id in self._known or self.store.get_manifest(manifest_id) is not None

    def _make_room_for_unknown_haves(self) -> None:
        """Haves may precede their manifest, but invented manifest ids must not evict real holders."""
        unknown = [m for m in self._holders if not self._is_known(m) and m not in self._active_fetches]
        if len(unknown) >= self.config.max_unknown_have_manifests:
            self._stats.hit_limit("unknown_have_manifests")
            del self._holders[unknown[0]]
            self._arriving.pop(unknown[0], None)

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

    def _lookup(self, manifest_id: bytes) -> SignedManifest | None:
        return self.store.get_manifest(manifest_id) or self._known.get(manifest_id)

    def holders(self, manifest_id: bytes) -> dict[str, set[int]]:
        """Peer -> the shards it announced it holds, verified."""
        return self._holders.get(manifest_id, {})

    def sources(self, manifest_id: bytes) -> dict[str, set[int]]:
        """Peer -> the shards we may ask it for: those it holds and, when we pass shards on too, those arriving."""
        held = self.holders(manifest_id)
        arriving = self._arriving.get(manifest_id) if self.config.pass_on_arriving else None
        if not arriving:
            return held
        out = dict(held)
        for peer, indices in arriving.items():
            if indices and peer in out:
                out[peer] = out[peer] | indices
        return out

    def arriving(self, manifest_id: bytes) -> dict[str, set[int]]:
        """Peer -> the shards it announced as on their way to it (empty unless we pass shards on too)."""
        return self._arriving.get(manifest_id, {}) if self.config.pass_on_arriving else {}

    def is_slow(self, peer: str) -> bool:
        """Whether shards from ``peer`` came at under a quarter of the median rate of the holders we measured."""
        rate = self._rate_by_peer.get(peer)
        if rate is None or len(self._rate_by_peer) < 2:
            return False
        rates = sorted(self._rate_by_peer.values())
        return rate < 0.25 * rates[len(rates) // 2]

    def forget_holding(self, manifest_id: bytes, peer: str, index: int) -> None:
        self._holders.get(manifest_id, {}).get(peer, set()).discard(index)
        self._arriving.get(manifest_id, {}).get(peer, set()).discard(index)

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
            peers = list(self.host.connected_peers())
            for start in range(0, len(haves) if peers else 0, MAX_HAVES_PER_MESSAGE):
                await self._take_have_token()
                await self._have_streams.send(Haves(haves=tuple(haves[start:start + MAX_HAVES_PER_MESSAGE])), peers)
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
        arriving = self.incoming.indices(manifest_id) - held if self.config.pass_on_arriving else set()
        if not held and not arriving:
            return None
        return Have(manifest_id=manifest_id, num_shards=n, bitfield=bitfield_from_indices(n, held),
                    arriving=bitfield_from_indices(n, arriving) if arriving else b"")

    async def _gossip(self, data: bytes) -> None:
        try:
            await self.host.publish(TOPIC, data)
        except TransportError as exc:
            log.warning("shardcast: gossip publish failed: %s", exc)

    def _validate_gossip(self, msg: GossipMessage) -> bool:
        if not self._gossip_flood.allow(msg.origin, trio.current_time()):
            self._stats.hit_limit("gossip_flood")
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
            # Gossiped Haves come from nodes that predate Have streams.
            self._heard(signed.signer, signed.message.haves if isinstance(signed.message, Haves) else (signed.message,))

    def _on_haves(self, peer: str, haves: Haves) -> bool:
        """Haves ``peer`` sent on its Have stream; False (and the peer charged) if it sends them faster than any
        honest node's Have limiter lets out."""
        if not self._gossip_flood.allow(peer, trio.current_time()):
            self._stats.hit_limit("have_flood")
            self._penalize(peer, "shard_have_flood")
            return False
        self._stats.haves_received += 1
        self._heard(peer, haves.haves)
        return True

    def _heard(self, holder: str, haves) -> None:
        for have in haves:
            known = self._known.get(have.manifest_id) or self.store.get_manifest(have.manifest_id)
            if known is not None and known.manifest.num_shards != have.num_shards:
                self._stats.gossip_rejected += 1
                continue
            self._record_holder(have.manifest_id, holder, bitfield_indices(have.bitfield, have.num_shards),
                                bitfield_indices(have.arriving, have.num_shards) if have.arriving else frozenset())

    # housekeeping

    async def _gc(self) -> None:
        async with self._gc_lock:
            protect = set(self._active_fetches) | self._releasing.keys()
            await trio.to_thread.run_sync(
                lambda: self.store.gc(keep_manifests=self.config.keep_manifests, protect=protect))
        # Seeding bookkeeping only matters while the manifest is still stored.
        for mid in [m for m in self._seeds if self.store.get_manifest(m) is None]:
            del self._seeds[mid]
