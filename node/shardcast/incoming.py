"""Shards on their way in, passed on as they arrive (cut-through).

A receiver that waits for a whole shard before serving it adds a shard's transfer time to every hop: with 1 MiB
shards sent four at a time over a 50 Mbit/s link, 0.7 s a hop, and at the start of a transfer nobody but the
publisher has anything to trade for that long. So a node fetching a shard announces it as arriving (Have.arriving)
and serves the bytes it has read to whoever asks, waiting for more as they come. Trust is unchanged: the last
bytes of a shard go out only once this node has verified the whole shard against its manifest hash; if that
fails, or the transfer in breaks off, the streams out are reset, so a receiver never completes a copy we did not
verify (and charges nobody for a reset). Each receiver still verifies its own copy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Callable

import trio

from protocol.errors import TransportError

MAX_PASS_ON_BYTES = 4 << 20
"""Larger shards are not passed on while arriving: their bytes would be held in memory until verified."""


class UpstreamFailed(TransportError):
    """The shard we were passing on did not arrive whole and verified; the stream out is reset."""


class Incoming:
    """One shard being received: the chunks read so far (immutable bytes, shared, never copied) and its outcome."""

    def __init__(self, manifest_id: bytes, index: int, nbytes: int):
        self.manifest_id = manifest_id
        self.index = index
        self.nbytes = nbytes
        self.chunks: list[bytes] = []
        self.verified = False
        self.failed = False
        self._news = trio.lowlevel.ParkingLot()

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self._news.unpark_all()

    def finish(self, ok: bool) -> None:
        """The shard verified (``ok``) or its transfer in failed: followers send the rest, or reset."""
        if self.verified or self.failed:
            return
        self.verified, self.failed = ok, not ok
        if not ok:
            self.chunks = []
        self._news.unpark_all()

    async def follow(self) -> AsyncIterator[bytes]:
        """Every chunk in order as it arrives; the one that completes the shard only once it is verified.

        Raises UpstreamFailed if the transfer in fails first. Waits as long as the transfer in runs: that has
        its own deadlines, and the caller bounds the whole send."""
        sent_chunks = 0
        sent = 0
        while sent < self.nbytes:
            if self.failed:
                raise UpstreamFailed(f"shard {self.index} failed on its way in; not passed on")
            if sent_chunks < len(self.chunks):
                chunk = self.chunks[sent_chunks]
                if sent + len(chunk) < self.nbytes or self.verified:
                    sent_chunks += 1
                    sent += len(chunk)
                    yield chunk
                    continue
            await self._news.park()


class IncomingShards:
    """The shards this node is receiving now that it may pass on, by manifest and index."""

    def __init__(self, on_change: Callable[[bytes], None] | None = None) -> None:
        self._by_key: dict[tuple[bytes, int], Incoming] = {}
        self._on_change = on_change or (lambda manifest_id: None)
        """Called with the manifest whenever one of its shards begins or stops arriving (its Have changes)."""

    def begin(self, manifest_id: bytes, index: int, nbytes: int) -> Incoming | None:
        """Register a shard whose body starts arriving; None when it is not passed on (too large, or already
        arriving on another transfer, a hedge's twin)."""
        key = (manifest_id, index)
        if nbytes > MAX_PASS_ON_BYTES or key in self._by_key:
            return None
        incoming = self._by_key[key] = Incoming(manifest_id, index, nbytes)
        self._on_change(manifest_id)
        return incoming

    def end(self, incoming: Incoming, ok: bool) -> None:
        """Its transfer is over: verified and stored (``ok``), or failed. Followers keep their reference."""
        incoming.finish(ok)
        if self._by_key.get((incoming.manifest_id, incoming.index)) is incoming:
            del self._by_key[(incoming.manifest_id, incoming.index)]
            self._on_change(incoming.manifest_id)

    def get(self, manifest_id: bytes, index: int) -> Incoming | None:
        return self._by_key.get((manifest_id, index))

    def indices(self, manifest_id: bytes) -> set[int]:
        return {i for (m, i) in self._by_key if m == manifest_id}
