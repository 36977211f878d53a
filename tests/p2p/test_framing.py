"""Length-prefixed frames: caps checked before allocation, truncation and clean EOF told apart."""

from __future__ import annotations

import struct

import pytest
import trio

from p2p.framing import read_exact, read_frame, recv_message, send_message, write_frame
from p2p_harness import connect
from protocol.errors import DecodeError, OversizeError, StreamClosed
from protocol.messages import Announce, HardwareSummary


class ScriptedStream:
    """Replays fixed chunks, then EOF; records how many bytes each read asked for."""

    remote_peer = "scripted"
    protocol = "/test"

    def __init__(self, *chunks: bytes):
        self._chunks = list(chunks)
        self.asked: list[int] = []
        self.written = bytearray()

    async def read(self, max_bytes: int) -> bytes:
        await trio.lowlevel.checkpoint()
        self.asked.append(max_bytes)
        if not self._chunks:
            return b""
        chunk = self._chunks.pop(0)
        head, rest = chunk[:max_bytes], chunk[max_bytes:]
        if rest:
            self._chunks.insert(0, rest)
        return head

    async def write(self, data) -> None:
        await trio.lowlevel.checkpoint()
        self.written += data


async def test_a_frame_round_trips_even_when_split_into_single_bytes():
    sink = ScriptedStream()
    await write_frame(sink, b"payload")
    assert bytes(sink.written) == struct.pack(">I", 7) + b"payload"
    source = ScriptedStream(*[bytes([b]) for b in sink.written])
    assert await read_frame(source, 100) == b"payload"
    assert await read_frame(source, 100) is None


async def test_an_oversized_length_is_refused_before_reading_the_body():
    source = ScriptedStream(struct.pack(">I", 2**31), b"x" * 16)
    with pytest.raises(OversizeError):
        await read_frame(source, max_bytes=1024)
    assert source.asked == [4]  # only the header was read; no body buffer was sized from the claim


async def test_a_truncated_body_raises_stream_closed():
    with pytest.raises(StreamClosed):
        await read_frame(ScriptedStream(struct.pack(">I", 10), b"abc"), 100)


async def test_a_truncated_header_raises_stream_closed():
    with pytest.raises(StreamClosed):
        await read_frame(ScriptedStream(b"\x00\x00"), 100)


async def test_clean_eof_at_a_frame_boundary_is_none():
    assert await read_frame(ScriptedStream(), 100) is None


async def test_read_exact_gathers_partial_reads_and_refuses_short_streams():
    assert await read_exact(ScriptedStream(b"ab", b"cd", b"ef"), 5) == b"abcde"
    with pytest.raises(StreamClosed):
        await read_exact(ScriptedStream(b"ab"), 5)


async def test_an_empty_frame_is_not_eof():
    sink = ScriptedStream()
    await write_frame(sink, b"")
    assert await read_frame(ScriptedStream(bytes(sink.written)), 10) == b""


def _announce() -> Announce:
    return Announce(peer_id="12D3KooWtest", seq=1, addrs=("/ip4/127.0.0.1/tcp/1",), version="0.1.0",
                    roles=("trainer",), hardware=HardwareSummary(devices=("cpu",), memory_bytes=1, tflops=0.5))


async def test_messages_round_trip_over_a_real_stream_pair(swarm):
    """Framing over both implementations, including a body larger than one muxer frame."""
    received = []

    async def serve(stream):
        received.append(await recv_message(stream, expect=Announce))
        received.append(await read_frame(stream, 1 << 20))
        received.append(await recv_message(stream))
        await write_frame(stream, b"ack")

    with trio.fail_after(20):
        async with swarm.hosts(2) as (a, b):
            b.set_stream_handler("/frames/1", serve)
            await connect(a, b)
            stream = await a.open_stream(b.peer_id, "/frames/1")
            await send_message(stream, _announce())
            await write_frame(stream, b"z" * 300_000)
            await stream.close_write()
            assert await read_frame(stream, 16) == b"ack"
            assert received == [_announce(), b"z" * 300_000, None]


async def test_recv_message_refuses_junk():
    with pytest.raises(DecodeError):
        await recv_message(ScriptedStream(struct.pack(">I", 3) + b"\xc1\xc1\xc1"))
