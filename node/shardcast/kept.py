"""Idle /shoal/shard/2 streams a fetcher keeps, per holder, for its next request to that holder."""

from __future__ import annotations

import trio

from p2p.api import Stream
from protocol.errors import StreamClosed

CLOSE_S = 1.0


class KeptStreams:
    """At most ``max_per_peer`` idle streams per holder, each for ``idle_s`` after its last exchange.

    A holder closes a kept stream after twice ``idle_s`` without a request, so a stream taken from here
    is almost always still open; the rare one the holder closed just as it was taken fails before any
    answer (transfer.Unanswered), and the request goes out again on a new stream.
    """

    def __init__(self, *, idle_s: float, max_per_peer: int):
        self.idle_s = idle_s
        self.max_per_peer = max_per_peer
        self._idle: dict[str, list[tuple[Stream, float]]] = {}

    def take(self, peer: str, now: float) -> Stream | None:
        """The most recently used idle stream to ``peer`` still within its idle time, or None."""
        streams = self._idle.get(peer)
        if not streams or now - streams[-1][1] >= self.idle_s:
            return None  # the newest has expired, so the rest have too: the sweep closes them
        stream, _ = streams.pop()
        if not streams:
            del self._idle[peer]
        return stream

    def keep(self, peer: str, stream: Stream, now: float) -> bool:
        """Keep ``stream`` for ``peer``'s next request; False (the caller closes it) when the peer has enough."""
        streams = self._idle.setdefault(peer, [])
        if len(streams) >= self.max_per_peer:
            return False
        streams.append((stream, now))
        return True

    def expired(self, now: float) -> list[Stream]:
        """Take out and return the streams idle for idle_s or longer (the caller closes them)."""
        out = []
        for peer in list(self._idle):
            fresh = [(s, t) for s, t in self._idle[peer] if now - t < self.idle_s]
            out += [s for s, t in self._idle[peer] if now - t >= self.idle_s]
            if fresh:
                self._idle[peer] = fresh
            else:
                del self._idle[peer]
        return out

    def count(self) -> int:
        return sum(len(v) for v in self._idle.values())


async def close_kept(stream: Stream) -> None:
    """End a kept stream cleanly: our EOF, then the holder's (it closes when it reads ours); a reset if it lags."""
    with trio.move_on_after(CLOSE_S, shield=True):
        try:
            await stream.close_write()
            while await stream.read(4096):
                pass  # nothing is due on an idle stream; whatever a holder sends past its answers is dropped
            await stream.close()
            return
        except StreamClosed:
            pass
    # The holder did not close within CLOSE_S, or the stream had died already.
    with trio.move_on_after(CLOSE_S, shield=True):
        await stream.reset()
