"""A libp2p stream seen through p2p.api.Stream: EOF is b"", a reset or lost connection is StreamClosed."""

from __future__ import annotations

from typing import Any

import trio
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF

from p2p.api import HostStatistics
from p2p.nat import is_relayed_stream
from protocol.errors import StreamClosed

_STREAM_ERRORS = (BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class _Stream:
    """A libp2p stream seen through p2p.api.Stream: EOF is b"", failures are StreamClosed, bytes are counted."""

    __slots__ = ("_raw", "_stats", "remote_peer", "protocol", "_relayed")

    def __init__(self, raw: Any, remote_peer: str, protocol: str, stats: HostStatistics):
        self._raw = raw
        self._stats = stats
        self.remote_peer = remote_peer
        self.protocol = protocol
        self._relayed = is_relayed_stream(raw)

    def _count_relayed(self, num_bytes: int) -> None:
        by_protocol = self._stats.relayed_bytes_by_protocol
        by_protocol[self.protocol] = by_protocol.get(self.protocol, 0) + num_bytes

    async def read(self, max_bytes: int) -> bytes:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, not {max_bytes}")
        try:
            data = await self._raw.read(max_bytes)
        except StreamEOF as exc:
            if _eof_is_genuine(self._raw):
                return b""
            raise StreamClosed(f"stream {self.protocol} from {self.remote_peer} was reset or lost") from exc
        except _STREAM_ERRORS as exc:
            raise StreamClosed(f"stream {self.protocol} from {self.remote_peer} failed: {exc!r}") from exc
        self._stats.bytes_received += len(data)
        self._count(self._stats.bytes_received_by_peer, len(data))
        return data

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        # Noise encrypts through APIs that want bytes; the copy is small next to the encryption cost.
        payload = data if isinstance(data, bytes) else bytes(data)
        try:
            await self._raw.write(payload)
        except _STREAM_ERRORS as exc:
            raise StreamClosed(f"stream {self.protocol} to {self.remote_peer} failed: {exc!r}") from exc
        self._stats.bytes_sent += len(payload)
        self._count(self._stats.bytes_sent_by_peer, len(payload))

    def _count(self, by_peer: dict[str, int], num_bytes: int) -> None:
        """Per-peer and relayed byte counters, one direction (the totals are counted by the caller)."""
        if self._relayed:
            self._count_relayed(num_bytes)
        by_peer[self.remote_peer] = by_peer.get(self.remote_peer, 0) + num_bytes

    async def close_write(self) -> None:
        try:
            await self._raw.close_write()
        except _STREAM_ERRORS as exc:
            raise StreamClosed(f"stream {self.protocol} to {self.remote_peer} failed: {exc!r}") from exc

    async def close(self) -> None:
        try:
            await self._raw.close()
        except _STREAM_ERRORS as exc:
            raise StreamClosed(f"stream {self.protocol} to {self.remote_peer} failed: {exc!r}") from exc

    async def reset(self) -> None:
        try:
            await self._raw.reset()
        except _STREAM_ERRORS:
            pass  # a reset of a dead stream has nothing left to do


def _eof_is_genuine(raw: Any) -> bool:
    """True only for a FIN from the peer.

    Yamux in 0.8.1 also raises EOF when an RST or a dying connection removes the stream while a
    read waits ("Stream was removed during read"); that must not look like a clean end.
    """
    muxed = getattr(raw, "muxed_stream", None)
    if muxed is None or not hasattr(muxed, "recv_closed"):
        return True
    return bool(muxed.recv_closed) and not getattr(muxed, "reset_received", False)
