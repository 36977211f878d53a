"""Length-prefixed frames (4-byte big-endian length + body) and codec messages over a p2p Stream."""

from __future__ import annotations

import struct
from typing import Any

from p2p.api import Stream
from protocol import codec
from protocol.errors import OversizeError, StreamClosed

HEADER_BYTES = 4
MAX_FRAME_BYTES = (1 << 32) - 1
READ_CHUNK_BYTES = 1 << 20
"""Upper bound of one read() call; a yamux frame is 64 KiB, so larger asks only cost allocation."""

_HEADER = struct.Struct(">I")


async def read_exact(stream: Stream, n: int) -> bytes:
    """Read exactly n bytes; StreamClosed if the stream ends first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        chunk = await stream.read(min(n - got, READ_CHUNK_BYTES))
        if not chunk:
            raise StreamClosed(f"stream ended after {got} of {n} bytes")
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return bytes(buf)


async def _read_header(stream: Stream) -> bytes | None:
    """The 4 header bytes, or None on EOF before the first one (a clean frame boundary)."""
    first = await stream.read(HEADER_BYTES)
    if not first:
        return None
    if len(first) == HEADER_BYTES:
        return first
    return first + await read_exact(stream, HEADER_BYTES - len(first))


async def write_frame(stream: Stream, body: bytes | bytearray | memoryview) -> None:
    if len(body) > MAX_FRAME_BYTES:
        raise OversizeError(f"a frame holds at most {MAX_FRAME_BYTES} bytes, not {len(body)}")
    # One write for small frames keeps them in one muxer frame; large bodies are not copied.
    if len(body) <= 64 * 1024:
        await stream.write(_HEADER.pack(len(body)) + bytes(body))
    else:
        await stream.write(_HEADER.pack(len(body)))
        await stream.write(body)


async def read_frame(stream: Stream, max_bytes: int) -> bytes | None:
    """The next frame's body; None on clean EOF; OversizeError before allocating an oversized body."""
    header = await _read_header(stream)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > max_bytes:
        raise OversizeError(f"peer announced a frame of {length} bytes; the cap is {max_bytes}")
    return await read_exact(stream, length)


async def send_message(stream: Stream, msg: Any) -> None:
    await write_frame(stream, codec.encode(msg))


async def recv_message(stream: Stream, max_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES, *,
                       expect: type | tuple[type, ...] | None = None) -> Any | None:
    """Decode the next frame as a codec message; None on clean EOF; DecodeError/OversizeError on junk."""
    body = await read_frame(stream, max_bytes)
    if body is None:
        return None
    return codec.decode(body, max_bytes=max_bytes, expect=expect)
