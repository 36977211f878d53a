"""What a gossip RPC costs on the wire: no signed peer record in it, and one read (so one Yamux window
update) for several frames instead of one per varint byte."""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IncompleteReadError, MessageTooLarge
from libp2p.network.stream.exceptions import StreamEOF

from p2p.guards import READ_CHUNK_BYTES, _FrameReader
from p2p.host import open_host
from p2p.rawpeer import varint
from p2p_harness import connect, fresh_keypair, make_config, wait_until


class ScriptedStream:
    """Answers each read with the next scripted chunk (at most n bytes of it), then EOF."""

    def __init__(self, *chunks: bytes):
        self.chunks, self.reads = [bytearray(c) for c in chunks], []

    async def read(self, n: int) -> bytes:
        self.reads.append(n)
        while self.chunks and not self.chunks[0]:
            self.chunks.pop(0)
        if not self.chunks:
            raise StreamEOF()
        chunk = bytes(self.chunks[0][:n])
        del self.chunks[0][:n]
        return chunk


def frame(body: bytes) -> bytes:
    return varint(len(body)) + body


async def frames_of(stream: ScriptedStream, max_bytes: int = 1 << 20) -> list[bytes]:
    reader, out = _FrameReader(stream), []
    while (f := await reader.next(max_bytes)) is not None:
        out.append(f)
    return out


async def test_several_frames_in_one_read_take_one_read():
    bodies = [b"a" * 10, b"", b"b" * 300, b"c" * 5]
    stream = ScriptedStream(b"".join(frame(b) for b in bodies))
    assert await frames_of(stream) == bodies
    assert stream.reads == [READ_CHUNK_BYTES, READ_CHUNK_BYTES]  # the data, then the clean end


async def test_frames_and_varints_split_across_reads_are_put_together():
    body = bytes(range(256)) * 3  # a two-byte varint
    data = frame(body) + frame(b"xy")
    chunks = [data[:1], data[1:2], data[2:100], data[100:-1], data[-1:]]
    assert await frames_of(ScriptedStream(*chunks)) == [body, b"xy"]


async def test_an_end_inside_a_frame_or_its_length_is_incomplete():
    with pytest.raises(IncompleteReadError):
        await frames_of(ScriptedStream(varint(1000) + b"x" * 10))
    with pytest.raises(IncompleteReadError):
        await frames_of(ScriptedStream(b"\x80"))


async def test_a_length_over_the_cap_is_refused_before_the_body_arrives():
    stream = ScriptedStream(varint(1 << 40) + b"x" * 10)
    with pytest.raises(MessageTooLarge):
        await _FrameReader(stream).next(1 << 20)
    assert len(stream.reads) == 1


async def test_a_varint_longer_than_ten_bytes_is_malformed():
    with pytest.raises(ParseError):
        await frames_of(ScriptedStream(b"\xff" * 12))


@asynccontextmanager
async def two_hosts_on(topic: str):
    """Two real hosts in one topic's mesh; yields them and b's subscription."""
    async with open_host(fresh_keypair(), make_config()) as a, open_host(fresh_keypair(), make_config()) as b:
        received = b.subscribe(topic, None)
        a.subscribe(topic, None)
        await connect(a, b)
        await a.wait_for_topic_peer(topic, b.peer_id)
        await b.wait_for_topic_peer(topic, a.peer_id)
        yield a, b, received


async def test_gossip_rpcs_leave_without_a_peer_record_and_cost_little_more_than_their_message():
    topic, count, size = "shoal-test/wire", 20, 1000
    with trio.fail_after(30):
        async with two_hosts_on(topic) as (a, b, received):
            written = []
            write_msg = a._pubsub.write_msg

            async def spy(stream, rpc_msg) -> bool:
                ok = await write_msg(stream, rpc_msg)
                written.append(rpc_msg.HasField("senderRecord"))
                return ok

            a._pubsub.write_msg = spy
            before = a.statistics().wire_bytes_sent
            for i in range(count):
                await a.publish(topic, i.to_bytes(2, "big") + bytes(size - 2))
                await received.receive()
                await trio.sleep(0.05)
            await wait_until(lambda: len(written) >= count)
            sent = a.statistics().wire_bytes_sent - before
            hello_has_record = a._pubsub.get_hello_packet().HasField("senderRecord")
    assert written and not any(written) and not hello_has_record
    # A message's own envelope (publisher, sequence number, topic, key, signature) is about 165 bytes,
    # Noise and Yamux framing about 30, the heartbeats' control RPCs about 80 each: about 1,330 bytes a
    # message here. py-libp2p's peer record in every RPC made it about 1,800.
    assert sent < count * (size + 400), sent


async def test_idontwant_goes_out_for_large_messages_only():
    topic = "shoal-test/idontwant"
    with trio.fail_after(30):
        async with two_hosts_on(topic) as (a, b, received):
            idontwants = []
            write_msg = b._pubsub.write_msg

            async def spy(stream, rpc_msg) -> bool:
                if rpc_msg.HasField("control"):
                    idontwants.extend(rpc_msg.control.idontwant)
                return await write_msg(stream, rpc_msg)

            b._pubsub.write_msg = spy
            for size in (100, 1000, 1023):
                await a.publish(topic, bytes(size))
                assert len((await received.receive()).data) == size
            await trio.sleep(0.5)
            assert not idontwants  # each would have cost an RPC of its own per mesh peer
            await a.publish(topic, bytes(4096))
            await received.receive()
            await wait_until(lambda: len(idontwants) == 1)
