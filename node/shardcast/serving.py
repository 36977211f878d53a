"""SHARDCAST's serving side: answer peers' manifest queries and shard requests, within per-peer and total caps.

The fetching side (service.py, fetcher.py) owns what the node knows of the swarm; the server only reads it:
the store, the manifests heard over gossip (``lookup``), who else holds a shard (``others_hold``) and the
super-seeding state of what this node published (``seeds``), and hands it the Haves peers send (``on_haves``).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Callable

import trio

from p2p.api import Host, Stream
from p2p.framing import send_message
from protocol.errors import RemoteProtocolError, TransferTimeout, TransportError
from protocol.manifest import (STATUS_BUSY, STATUS_MISSING, STATUS_OK, STATUS_SEEDED, Haves, ManifestRequest,
                               ManifestResponse, ShardRequest, SignedManifest, bitfield_from_indices)
from protocol.scores import FloodLimiter

from node.shardcast import transfer
from node.shardcast.config import ShardcastConfig, ShardcastStatistics
from node.shardcast.haves import HAVE_PROTOCOL, HAVES_MAX_BYTES
from node.shardcast.incoming import IncomingShards
from node.shardcast.kept import close_kept
from node.shardcast.seed import Seed
from node.shardcast.store import ShardStore

log = logging.getLogger(__name__)

MANIFEST_PROTOCOL = "/shoal/manifest/1"
MAX_HAVE_STREAMS_PER_PEER = 2
"""Inbound /shoal/have/1 streams one peer may hold open: its kept one, and the next while the last is torn down."""
ASKERS_WINDOW_S = 1.0
"""A peer that asked for a shard this recently shares the upload slots (it retries a busy answer within 0.25 s)."""


@contextlib.contextmanager
def _counted(counter: Counter[str], peer: str):
    """One more of ``peer``'s streams in ``counter`` while inside; peers with none leave the counter."""
    counter[peer] += 1
    try:
        yield
    finally:
        counter[peer] -= 1
        if not counter[peer]:
            del counter[peer]


class FairUploads:
    """The upload slots, shared among the peers asking for shards now.

    A peer may hold at most its share of the slots: all of them divided among the peers that asked within the last
    ``window_s`` (at least one). Without a share, the receiver whose requests reach a publisher first took every
    slot, and the others were told busy for a second or more with nothing to trade among themselves; alone, a
    receiver still gets every slot."""

    def __init__(self, slots: int, window_s: float):
        self.slots = slots
        self.window_s = window_s
        self._held: Counter[str] = Counter()
        self._asked_at: dict[str, float] = {}

    def take(self, peer: str, now: float) -> bool:
        """Whether ``peer`` may start one more upload now (then release() it when done)."""
        self._asked_at[peer] = now
        cutoff = now - self.window_s
        self._asked_at = {p: t for p, t in self._asked_at.items() if t >= cutoff}
        share = max(1, self.slots // len(self._asked_at))
        if self._held.total() >= self.slots or self._held[peer] >= share:
            return False
        self._held[peer] += 1
        return True

    def release(self, peer: str) -> None:
        self._held[peer] -= 1
        if self._held[peer] <= 0:
            del self._held[peer]


class ShardServer:
    """Serves a node's verified shards and manifests to peers; ``register(host)`` installs its handlers.

    Every inbound stream counts against ``max_streams_per_peer`` and ``max_streams`` while it waits for a request
    and while it is answered; a kept /shoal/shard/2 stream waiting for its next request counts only as idle
    (``max_idle_streams_per_peer``). A peer is charged for what only a hostile peer does: garbage, a stalled
    read, too many streams, a loop of requests for what we do not hold.
    """

    def __init__(self, *, store: ShardStore, config: ShardcastConfig, stats: ShardcastStatistics,
                 seeds: dict[bytes, Seed], penalize: Callable[[str, str], None],
                 lookup: Callable[[bytes], SignedManifest | None],
                 others_hold: Callable[[bytes, int, str], bool],
                 on_haves: Callable[[str, Haves], bool], incoming: IncomingShards):
        self.store = store
        self.incoming = incoming
        """Shards still arriving here, served on as they come (incoming.py)."""
        self.config = config
        self._stats = stats
        self._seeds = seeds
        self._penalize = penalize
        self._lookup = lookup
        self._others_hold = others_hold
        self._on_haves = on_haves
        self.served_at: dict[bytes, float] = {}
        """When a peer last asked for each manifest we hold (its manifest, or a shard of it)."""
        self._streams_by_peer: Counter[str] = Counter()
        self._idle_by_peer: Counter[str] = Counter()
        """Inbound /shoal/shard/2 streams waiting for their peer's next request."""
        self._have_streams: Counter[str] = Counter()
        self._uploads = FairUploads(config.max_uploads, ASKERS_WINDOW_S)
        self._unknown_requests = FloodLimiter(rate_per_s=config.unknown_requests_per_s,
                                              burst=config.unknown_request_burst)

    def register(self, host: Host) -> None:
        for protocol in transfer.SHARD_PROTOCOLS:
            host.set_stream_handler(protocol, self.serve_shard)
        host.set_stream_handler(MANIFEST_PROTOCOL, self.serve_manifest)
        host.set_stream_handler(HAVE_PROTOCOL, self.serve_haves)

    def forget_served_before(self, cutoff: float) -> None:
        """Drop the record of askers older than ``cutoff`` (trio time)."""
        self.served_at = {m: t for m, t in self.served_at.items() if t >= cutoff}

    def idle_streams(self) -> int:
        return self._idle_by_peer.total()

    def _serving(self, manifest_id: bytes) -> None:
        self.served_at[manifest_id] = trio.current_time()

    def _refuse(self, peer: str, reason: str, detail: object, *, charge: bool = True) -> None:
        """Count an inbound stream we refused and, when the peer is to blame, charge it ``shard_<reason>``."""
        log.debug("shardcast: refused a stream from %s (%s): %s", peer, reason, detail)
        rejected = self._stats.requests_rejected
        rejected[reason] = rejected.get(reason, 0) + 1
        if charge:
            self._penalize(peer, f"shard_{reason}")

    @contextlib.contextmanager
    def _admit(self, peer: str):
        """Count an inbound stream against the per-peer and total caps; yields whether it may proceed."""
        cfg = self.config
        if self._streams_by_peer[peer] >= cfg.max_streams_per_peer:
            self._refuse(peer, "too_many_streams", f"{cfg.max_streams_per_peer} already open")
            yield False
            return
        if self._streams_by_peer.total() >= cfg.max_streams:
            self._stats.hit_limit("streams_total")
            self._refuse(peer, "busy", f"{cfg.max_streams} streams open", charge=False)
            yield False
            return
        with _counted(self._streams_by_peer, peer):
            yield True

    def _allow_unknown(self, peer: str) -> bool:
        """False (and the peer charged) once it asks for things we do not hold faster than any honest peer."""
        if self._unknown_requests.allow(peer, trio.current_time()):
            return True
        self._refuse(peer, "unknown_flood", "too many requests for unknown manifests or shards")
        return False

    async def serve_manifest(self, stream: Stream) -> None:
        peer = stream.remote_peer
        with self._admit(peer) as admitted:
            if not admitted:
                await transfer.abort(stream)
                return
            try:
                req = await transfer.read_control(stream, self.config.deadlines(), 1024, ManifestRequest)
            except transfer.Refused as exc:
                self._refuse(peer, exc.reason, exc, charge=exc.charge)
                await transfer.abort(stream)
                return
            signed = self._lookup(req.manifest_id)
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
                self._refuse(peer, "stalled", "did not read the manifest response")
                await transfer.abort(stream)
            except TransportError as exc:
                log.debug("shardcast: manifest response to %s failed: %s", peer, exc)
                await transfer.abort(stream)

    async def serve_haves(self, stream: Stream) -> None:
        """A peer's Haves, each handed to on_haves, until it closes the stream or leaves it idle for twice the
        re-announcement interval. Kept streams count apart from the others: at most MAX_HAVE_STREAMS_PER_PEER per
        peer and max_streams in all."""
        peer = stream.remote_peer
        cfg = self.config
        if self._have_streams[peer] >= MAX_HAVE_STREAMS_PER_PEER:
            self._refuse(peer, "too_many_streams", f"{MAX_HAVE_STREAMS_PER_PEER} Have streams already open")
            await transfer.abort(stream)
            return
        if self._have_streams.total() >= cfg.max_streams:
            self._stats.hit_limit("streams_total")
            self._refuse(peer, "busy", f"{cfg.max_streams} Have streams open", charge=False)
            await transfer.abort(stream)
            return
        with _counted(self._have_streams, peer):
            while (haves := await self._next_on_kept(stream, 2 * cfg.reannounce_interval_s, HAVES_MAX_BYTES,
                                                     Haves)) is not None:
                if not self._on_haves(peer, haves):
                    await transfer.abort(stream)
                    return

    async def _next_on_kept(self, stream: Stream, idle_s: float, max_bytes: int, expect: type):
        """The next message on a kept inbound stream; None once the stream is done with: closed when the peer
        closed it or left it idle for ``idle_s``, reset (and the peer charged where it is to blame) for what
        no honest peer sends."""
        try:
            msg = await transfer.read_next(stream, idle_s, max_bytes, expect)
        except transfer.Refused as exc:
            self._refuse(stream.remote_peer, exc.reason, exc, charge=exc.charge)
            await transfer.abort(stream)
            return None
        if msg is None:
            await close_kept(stream)
        return msg

    async def serve_shard(self, stream: Stream) -> None:
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
                    self._refuse(peer, exc.reason, exc, charge=exc.charge)
                    await transfer.abort(stream)
                    return
                if not await self.answer_shard(stream, peer, req) or not transfer.keeps_open(stream):
                    return
            if (self._idle_by_peer[peer] >= cfg.max_idle_streams_per_peer
                    or self._idle_by_peer.total() >= cfg.max_streams):
                await close_kept(stream)
                return
            with _counted(self._idle_by_peer, peer):
                req = await self._next_on_kept(stream, 2 * cfg.stream_idle_s, transfer.CONTROL_MAX_BYTES,
                                               ShardRequest)
            if req is None:
                return

    async def answer_shard(self, stream: Stream, peer: str, req) -> bool:
        """Answer one request; returns whether the stream is still open for another (on /shoal/shard/2)."""
        cfg = self.config
        signed = self.store.get_manifest(req.manifest_id)
        m = signed.manifest if signed else None
        known = m is not None and req.index < m.num_shards
        held = known and self.store.has_shard(m.shard_hashes[req.index])
        arriving = self.incoming.get(req.manifest_id, req.index) if known and not held else None
        if not held and arriving is None:
            if self._allow_unknown(peer):
                return await transfer.refuse(stream, req, STATUS_MISSING, cfg.deadlines())
            await transfer.abort(stream)
            return False
        seed = self._seeds.get(req.manifest_id)
        others_hold = seed is not None and self._others_hold(req.manifest_id, req.index, peer)
        if seed is not None and seed.decide(req.index, fallback=req.fallback, now=trio.current_time(),
                                            others_hold=others_hold) != STATUS_OK:
            self._stats.uploads_refused_seeded += 1
            return await transfer.refuse(stream, req, STATUS_SEEDED, cfg.deadlines())
        if not self._uploads.take(peer, trio.current_time()):
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

        def count(nbytes: int) -> None:
            stats.bytes_served += nbytes
            stats.bytes_served_by_peer[peer] = stats.bytes_served_by_peer.get(peer, 0) + nbytes

        try:
            # A shard held in memory is sent from there; ``source`` keeps that memory alive for the whole send.
            source = arriving or self.store.held_in_memory(sha) or self.store.shard_path(sha)
            if arriving is not None:
                stats.uploads_passed_on += 1
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
        except TransferTimeout as exc:
            # A receiver that stopped reading is charged; one on a slow link (below min_rate) is only counted.
            stats.upload_failures += 1
            self._refuse(peer, "stalled" if isinstance(exc, transfer.Stalled) else "slow", exc,
                         charge=isinstance(exc, transfer.Stalled))
        except (RemoteProtocolError, TransportError, OSError) as exc:
            stats.upload_failures += 1
            log.debug("shardcast: upload of shard %d to %s failed: %s", req.index, peer, exc)
        finally:
            stats.uploads_active -= 1
            self._uploads.release(peer)
            self._serving(req.manifest_id)
            if seed is not None:
                seed.end(req.index, started, trio.current_time(), ok=acked, peer=peer)
        return acked
