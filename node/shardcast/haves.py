"""Haves on direct streams: what a node holds goes to each connected peer once, not through gossip.

A gossiped message reaches every node about once per mesh peer, and every node relays it to its own mesh, so
a swarm's Have traffic costs each node in proportion to the whole swarm's. With 16 receivers of one 32 MiB set
on this machine, gossip took about half of each receiver's CPU (py-spy --gil), and the set reached every
receiver in 16 s without any Haves against about 30 s with gossiped ones. A fetch only asks connected peers, so
those are the ones a Have is for. Noise has authenticated the stream's other end, so its Haves speak for that
peer with no signature to make or check.

One kept outbound stream per peer (``/shoal/have/1``), written by one task at a time: the announce loop.
"""

from __future__ import annotations

import logging

import trio

from p2p.api import Host, Stream
from p2p.framing import write_frame
from protocol import codec
from protocol.errors import RemoteProtocolError, TransportError
from protocol.manifest import Haves

from node.shardcast import transfer
from node.shardcast.config import ShardcastStatistics

log = logging.getLogger(__name__)

HAVE_PROTOCOL = "/shoal/have/1"
HAVES_MAX_BYTES = 64 * 1024
"""A Haves message: at most MAX_HAVES_PER_MESSAGE manifests, each a bitfield of a bit per shard."""


class HaveStreams:
    """Our outbound /shoal/have/1 stream to each peer, opened on first use and kept while it works.

    A peer that cannot take one (an older node, or one that refused) is not asked again for ``retry_after_s``;
    it still learns what we hold by asking (a manifest query answers with our bitfield).
    """

    def __init__(self, host: Host, stats: ShardcastStatistics, *, timeout_s: float, retry_after_s: float):
        self.host = host
        self._stats = stats
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._streams: dict[str, Stream] = {}
        self._failed_at: dict[str, float] = {}

    async def send(self, haves: Haves, peers: list[str]) -> None:
        """Write ``haves`` to each of ``peers``, side by side, each bounded by timeout_s."""
        body = codec.encode(haves)
        now = trio.current_time()
        self._forget_gone(set(peers))
        async with trio.open_nursery() as nursery:
            for peer in peers:
                if now - self._failed_at.get(peer, -float("inf")) >= self.retry_after_s:
                    nursery.start_soon(self._send_one, peer, body)

    async def _send_one(self, peer: str, body: bytes) -> None:
        stream = self._streams.get(peer)
        try:
            with trio.fail_after(self.timeout_s):
                if stream is None:
                    stream = await self.host.open_stream(peer, HAVE_PROTOCOL)
                    self._streams[peer] = stream
                await write_frame(stream, body)
            self._stats.haves_sent += 1
        except (TransportError, RemoteProtocolError, trio.TooSlowError) as exc:
            log.debug("shardcast: Haves to %s failed: %s", peer, exc)
            self._failed_at[peer] = trio.current_time()
            if self._streams.pop(peer, None) is not None:
                await transfer.abort(stream)

    def _forget_gone(self, connected: set[str]) -> None:
        for peer in [p for p in self._streams if p not in connected]:
            del self._streams[peer]  # its connection is gone, and the stream with it
        for peer in [p for p in self._failed_at if p not in connected]:
            del self._failed_at[peer]
