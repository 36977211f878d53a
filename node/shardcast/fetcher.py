"""One multi-source fetch: rarest shard first, the holder that should finish it soonest, re-fetch on failure."""

from __future__ import annotations

import bisect
import contextlib
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import trio

from protocol.errors import IntegrityError, OversizeError, RemoteProtocolError, TransferTimeout, TransportError
from protocol.manifest import STATUS_BUSY, STATUS_OK, STATUS_SEEDED, SignedManifest

from node.shardcast import transfer

if TYPE_CHECKING:
    from node.shardcast.service import ShardcastService

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FetchProgress:
    bytes_done: int
    bytes_total: int
    bytes_per_s: float
    """Verified bytes fetched in this call, over its elapsed time (shards already on disk excluded)."""
    num_sources: int
    """Distinct peers that delivered at least one verified shard in this call."""


class FetchState:
    """Bookkeeping for one fetch; the service owns holders, limits and statistics."""

    def __init__(self, service: "ShardcastService", signed: SignedManifest,
                 progress: Callable[[FetchProgress], None] | None):
        self.svc = service
        self.signed = signed
        self.manifest = signed.manifest
        self.mid = signed.manifest_id
        self.publisher = signed.signer
        self.progress = progress
        self.missing = set(range(self.manifest.num_shards)) - service.store.held_indices(self.mid)
        self.bytes_done = self.manifest.total_bytes - sum(self.manifest.shard_size(i) for i in self.missing)
        self.bytes_new = 0
        self.inflight: dict[int, str] = {}
        self.begun: dict[int, float] = {}
        self.hedged: dict[int, str] = {}
        """Shards also asked of a second holder because the first is overdue; the first to verify wins."""
        self.scopes: dict[tuple[int, bool], trio.CancelScope] = {}
        """(shard, is_hedge) -> the transfer's scope, so the copy that verifies first can cancel its twin."""
        self.shard_s: list[float] = []
        """Seconds each shard took, kept sorted for its median."""
        self.busy_at: dict[str, float] = {}
        self.seeded_at: dict[int, float] = {}
        self.failed_at: dict[tuple[int, str], float] = {}
        self.peer_failures: dict[str, int] = {}
        self.peer_failed_at: dict[str, float] = {}
        self.banned: set[str] = set()
        self.sources: set[str] = set()
        self.started_at = trio.current_time()
        self.last_progress_at = self.started_at

    def bytes_per_s(self) -> float:
        elapsed = trio.current_time() - self.started_at
        return self.bytes_new / elapsed if elapsed > 0 else 0.0

    async def run(self) -> None:
        svc, cfg = self.svc, self.svc.config
        if len(self.missing) < self.manifest.num_shards:
            svc._mark_dirty(self.mid)
        last_query_at = -float("inf")
        stalled = False
        async with trio.open_nursery() as nursery:
            while self.missing:
                now = trio.current_time()
                if now - self.last_progress_at > cfg.stall_timeout_s:
                    stalled = True  # raised below, outside the nursery, as itself rather than in a group
                    break
                changed = svc._changed
                while len(self.inflight) < cfg.max_downloads and (pick := self._pick(now)) is not None:
                    index, peer, fallback = pick
                    self.inflight[index] = peer
                    self.begun[index] = now
                    svc._inflight_by_peer[peer] += 1
                    nursery.start_soon(self._fetch_one, index, peer, fallback, False)
                # Hedges take no download slot: the overdue transfers they back up hold those, mostly idle.
                while len(self.hedged) < cfg.max_downloads and (pick := self._pick_hedge(now)) is not None:
                    index, peer, fallback = pick
                    self.hedged[index] = peer
                    svc._inflight_by_peer[peer] += 1
                    nursery.start_soon(self._fetch_one, index, peer, fallback, True)
                wake_at = now + cfg.query_interval_s
                starved = len(self.inflight) < min(cfg.max_downloads, len(self.missing))
                if starved and now - last_query_at >= cfg.query_interval_s:
                    # Holders we have not heard of (joined before us, gossip lost): ask around.
                    last_query_at = now
                    nursery.start_soon(svc.query_peers, self.mid)
                retry_times = [t + cfg.busy_retry_s for t in self.busy_at.values()]
                retry_times += [t + cfg.reseed_after_s for t in self.seeded_at.values()]
                retry_times += [t + cfg.failure_backoff_s for t in self.failed_at.values()]
                hedge_after_s = self._hedge_after_s()
                retry_times += [t + hedge_after_s for i, t in self.begun.items() if i not in self.hedged]
                wake_at = min([wake_at, *[t for t in retry_times if t > now]])
                with trio.move_on_at(wake_at):
                    await changed.wait()
            nursery.cancel_scope.cancel()
        if stalled:
            raise TransferTimeout(f"no shard of {self.manifest.label or self.mid.hex()[:16]} arrived "
                                  f"for {cfg.stall_timeout_s:.0f} s; {len(self.missing)} still missing")

    def _eligible(self, now: float) -> dict[str, set[int]]:
        """Holder -> the shards it holds, for the holders we may ask anything of now.

        Worked out once per pick, not once per missing shard: a fetch of hundreds of shards picks after every
        shard, and listing the connected peers (a base58 string each) per shard made picking grow with the
        square of the set."""
        cfg = self.svc.config
        connected = set(self.svc.host.connected_peers())
        out = {}
        for peer, held in self.svc.sources(self.mid).items():
            if cfg.single_source and peer != self.publisher:
                continue
            if peer not in connected or peer in self.banned:
                continue
            failures = self.peer_failures.get(peer, 0)
            if failures >= cfg.max_failures_per_peer and (
                    now - self.peer_failed_at.get(peer, -float("inf")) < failures * cfg.failure_backoff_s):
                continue  # a holder that keeps failing rests longer each time, but is never written off
            if now - self.busy_at.get(peer, -float("inf")) < cfg.busy_retry_s:
                continue
            out[peer] = held
        return out

    def _candidates(self, index: int, now: float, eligible: dict[str, set[int]]) -> list[str]:
        """The holders in ``eligible`` we may ask for shard ``index`` now."""
        cfg = self.svc.config
        out = []
        for peer, held in eligible.items():
            if index not in held:
                continue
            if now - self.failed_at.get((index, peer), -float("inf")) < cfg.failure_backoff_s:
                continue
            if peer == self.publisher and now - self.seeded_at.get(index, -float("inf")) < cfg.reseed_after_s:
                continue  # the publisher sent it out already: wait for the Have of whoever got it
            out.append(peer)
        return out

    def _pick(self, now: float) -> tuple[int, str, bool] | None:
        """(shard, holder, fallback) to fetch next, or None if nothing can start now."""
        eligible = self._eligible(now)
        if not eligible:
            return None
        best = None
        for index in self.missing - self.inflight.keys() - self.hedged.keys():
            peers = self._candidates(index, now, eligible)
            if not peers:
                continue
            # Rarest first spreads copies; the random tie-break makes receivers begin with different shards.
            key = (len(peers), random.random())
            if best is None or key < best[0]:
                best = (key, index, peers)
        if best is None:
            return None
        _, index, peers = best
        held, arriving = self._others(index, peers)
        # The publisher's upload must not grow with the number of receivers: it is the last resort. A shard only
        # arriving elsewhere is asked of the publisher first, which sends us to the swarm (and is not asked again
        # for a while) or, if its first copy is overdue (a slow recipient, passing it on as slowly), sends another;
        # then of a holder it is arriving at, unless we measured that holder slow.
        if held:
            pool = held
        elif self.publisher in peers:
            pool = [self.publisher]
        else:
            pool = [p for p in arriving if not self.svc.is_slow(p)] or peers
        # A holder with an overdue transfer to us is slow (or hostile): ask it only if nobody else has the shard.
        overdue = self._overdue_peers(now)
        pool = [p for p in pool if p not in overdue] or pool
        peer = min(pool, key=lambda p: (self.svc.expected_finish_s(p), random.random()))
        # Fallback tells a seeding publisher that nobody else holds this shard whole to serve us now; if its first
        # copy is overdue (a slow recipient passing it on as slowly), it may then send another.
        fallback = self.svc.config.single_source or not held
        return index, peer, fallback

    def _others(self, index: int, peers: list[str]) -> tuple[list[str], list[str]]:
        """Of ``peers``, those other than the publisher holding shard ``index`` whole, and those it is arriving at."""
        arriving = self.svc.arriving(self.mid)
        held, coming = [], []
        for p in peers:
            if p != self.publisher:
                (coming if index in arriving.get(p, ()) else held).append(p)
        return held, coming

    def _hedge_after_s(self) -> float:
        """A shard running this long is overdue: three times the median shard so far, at least hedge_after_s."""
        typical = self.shard_s[len(self.shard_s) // 2] if self.shard_s else 0.0
        return max(self.svc.config.hedge_after_s, 3.0 * typical)

    def _overdue_peers(self, now: float) -> set[str]:
        limit = self._hedge_after_s()
        return {self.inflight[i] for i, begun in self.begun.items() if now - begun > limit}

    def _pick_hedge(self, now: float) -> tuple[int, str, bool] | None:
        """With nothing new to ask for, the overdue shard to ask a second holder for, and whom (endgame)."""
        best = None
        limit = self._hedge_after_s()
        eligible = None
        for index, begun in self.begun.items():
            if index in self.hedged or now - begun < limit:
                continue
            if eligible is None:
                eligible = self._eligible(now)
            peers = [p for p in self._candidates(index, now, eligible) if p != self.inflight[index]]
            if peers and (best is None or begun < best[0]):
                best = (begun, index, peers)
        if best is None:
            return None
        _, index, peers = best
        held, arriving = self._others(index, peers)
        peer = min(held or arriving or peers, key=lambda p: (self.svc.expected_finish_s(p), random.random()))
        return index, peer, not held

    async def _fetch_one(self, index: int, peer: str, fallback: bool, hedge: bool = False) -> None:
        with trio.CancelScope() as scope:
            self.scopes[(index, hedge)] = scope
            try:
                status = await self._fetch_from(index, peer, fallback, hedge)
            finally:
                del self.scopes[(index, hedge)]
        if scope.cancelled_caught:
            return
        if status == STATUS_OK and (twin := self.scopes.get((index, not hedge))) is not None:
            twin.cancel()  # the slower copy of a shard we now hold

    async def _fetch_from(self, index: int, peer: str, fallback: bool, hedge: bool) -> str | None:
        svc, cfg = self.svc, self.svc.config
        stats = svc._stats
        size = self.manifest.shard_size(index)
        status = None
        try:
            async with contextlib.nullcontext() if hedge else svc._download_limiter:
                stats.downloads_active += 1
                try:
                    stream, kept = await svc.shard_stream(peer)
                    started = trio.current_time()
                    try:
                        status = await self._ask(stream, index, size, fallback)
                    except transfer.Unanswered:
                        if not kept:
                            raise
                        # A kept stream the holder closed as idle just as we asked: once more, on a new one.
                        stream, _ = await svc.shard_stream(peer, fresh=True)
                        started = trio.current_time()
                        status = await self._ask(stream, index, size, fallback)
                    await svc.done_with_shard_stream(peer, stream)
                    if status == STATUS_OK:
                        svc.record_rate(peer, size, trio.current_time() - started)
                finally:
                    stats.downloads_active -= 1
        except (RemoteProtocolError, transfer.Stalled) as exc:
            # Bad bytes or a stall: this holder is done for this fetch, and it costs it score.
            svc._reject(peer, reject_reason(exc), exc)
            self.banned.add(peer)
            stats.download_failures += 1
        except (TransportError, trio.TooSlowError) as exc:
            # Unreachable, closed, or merely slower than the overall deadline: retry elsewhere, charge nobody.
            log.debug("shardcast: shard %d from %s failed: %s", index, peer, exc)
            self.failed_at[(index, peer)] = trio.current_time()
            self.peer_failures[peer] = self.peer_failures.get(peer, 0) + 1
            self.peer_failed_at[peer] = trio.current_time()
            stats.download_failures += 1
        finally:
            if hedge:
                del self.hedged[index]
            else:
                del self.inflight[index]
                began = self.begun.pop(index)
                if status == STATUS_OK:
                    bisect.insort(self.shard_s, trio.current_time() - began)
            svc._inflight_by_peer[peer] -= 1
            if not svc._inflight_by_peer[peer]:
                del svc._inflight_by_peer[peer]
            svc._notify()
        if status == STATUS_OK:
            if index in self.missing:
                self._done(index, peer, size)
        elif status == STATUS_BUSY:
            self.busy_at[peer] = trio.current_time()
        elif status == STATUS_SEEDED:
            self.seeded_at[index] = trio.current_time()
        elif status is not None:
            svc.forget_holding(self.mid, peer, index)
            self.failed_at[(index, peer)] = trio.current_time()
        return status

    async def _ask(self, stream, index: int, size: int, fallback: bool) -> str:
        svc = self.svc
        # A quiet manifest sends no Haves, so nobody would ask us for its shards while they arrive.
        passing_on = svc.config.pass_on_arriving and self.mid not in svc._quiet
        return await transfer.fetch_shard(stream, svc.store, manifest_id=self.mid, index=index,
                                          sha256=self.manifest.shard_hashes[index], nbytes=size,
                                          deadlines=svc.config.download_deadlines(), fallback=fallback,
                                          incoming=svc.incoming if passing_on else None)

    def _done(self, index: int, peer: str, size: int) -> None:
        svc = self.svc
        stats = svc._stats
        self.missing.discard(index)
        self.bytes_done += size
        self.bytes_new += size
        self.sources.add(peer)
        self.last_progress_at = trio.current_time()
        stats.shards_fetched += 1
        stats.bytes_fetched += size
        stats.bytes_fetched_by_peer[peer] = stats.bytes_fetched_by_peer.get(peer, 0) + size
        svc._mark_dirty(self.mid)
        if self.progress is not None:
            self.progress(FetchProgress(bytes_done=self.bytes_done, bytes_total=self.manifest.total_bytes,
                                        bytes_per_s=self.bytes_per_s(), num_sources=len(self.sources)))


def reject_reason(exc: BaseException) -> str:
    """The statistics and penalty label for a shard we refused."""
    if isinstance(exc, OversizeError):
        return "oversize"
    if isinstance(exc, IntegrityError):
        return "bad_hash" if "hash" in str(exc) else "bad_size"
    if isinstance(exc, TransferTimeout):
        return "timeout"  # only a Stalled holder is charged: no bytes for a whole inactivity deadline
    return "protocol"
