"""One shard over one stream on the FakeNetwork: happy path, hostile headers and bodies, deadlines."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
import trio

from p2p.fake import FakeNetwork
from p2p.framing import send_message
from protocol.errors import IntegrityError, OversizeError, RemoteProtocolError, StreamClosed, TransferTimeout
from protocol.keys import Keypair
from protocol.manifest import STATUS_BUSY, STATUS_OK, ShardHeader, ShardRequest

from node.shardcast import transfer
from node.shardcast.store import HeldShard, ShardStore

MID = hashlib.sha256(b"manifest").digest()
DATA = os.urandom(300 * 1024)  # larger than the fake's 256 KiB stream buffer
SHA = hashlib.sha256(DATA).digest()
FAST = transfer.Deadlines(inactivity_s=0.5, base_s=2.0)


@pytest.fixture
async def pair(nursery):
    net = FakeNetwork()
    a = await nursery.start(_host, net, "a")
    b = await nursery.start(_host, net, "b")
    await a.connect(b.listen_addrs()[0])
    return a, b


async def _host(net, label, task_status=trio.TASK_STATUS_IGNORED):
    async with net.open_host(Keypair.from_label(label)) as host:
        task_status.started(host)
        await trio.sleep_forever()


def _serve_with(host, body, protocol=transfer.SHARD_PROTOCOL):
    """Register a handler that reads the request and then runs ``body(stream, req)``."""
    results = []

    async def handler(stream):
        req = await transfer.read_request(stream, FAST)
        results.append(await body(stream, req))

    host.set_stream_handler(protocol, handler)
    return results


async def _fetch(a, b, store, *, nbytes=len(DATA), sha=SHA, deadlines=FAST, protocol=transfer.SHARD_PROTOCOL):
    stream = await a.open_stream(b.peer_id, protocol)
    return await transfer.fetch_shard(stream, store, manifest_id=MID, index=0, sha256=sha, nbytes=nbytes,
                                      deadlines=deadlines)


def _assert_clean(store, tmp_path):
    assert not store.has_shard(SHA)
    assert list((tmp_path / "tmp").iterdir()) == []


async def test_shard_round_trip_waits_for_the_ack(pair, tmp_path):
    a, b = pair
    src = tmp_path / "src.bin"
    src.write_bytes(DATA)
    sent = _serve_with(b, lambda s, r: transfer.send_shard(s, r, source=src, sha256=SHA, nbytes=len(DATA),
                                                          deadlines=FAST))
    store = ShardStore.open(tmp_path / "store")
    with trio.fail_after(10):
        assert await _fetch(a, b, store) == STATUS_OK
        while not sent:
            await trio.sleep(0.005)
    assert store.read_shard(SHA) == DATA
    assert sent[0].ok and sent[0].bytes_sent == len(DATA) and not sent[0].disk_corrupt


async def test_a_shard_that_rotted_on_the_senders_disk_is_flagged_after_the_nack(pair, tmp_path):
    a, b = pair
    src = tmp_path / "src.bin"
    src.write_bytes(b"\xff" + DATA[1:])  # corrupted after the store verified it
    sent = _serve_with(b, lambda s, r: transfer.send_shard(s, r, source=src, sha256=SHA, nbytes=len(DATA),
                                                          deadlines=FAST))
    store = ShardStore.open(tmp_path / "store")
    with trio.fail_after(10):
        with pytest.raises(IntegrityError):
            await _fetch(a, b, store)
        while not sent:
            await trio.sleep(0.005)
    assert not sent[0].ok and sent[0].disk_corrupt
    _assert_clean(store, tmp_path / "store")


async def test_refusal_carries_status(pair, tmp_path):
    a, b = pair
    _serve_with(b, lambda s, r: transfer.refuse(s, r, STATUS_BUSY, FAST))
    store = ShardStore.open(tmp_path)
    with trio.fail_after(10):
        assert await _fetch(a, b, store) == STATUS_BUSY


async def test_truncated_header_is_rejected_cleanly(pair, tmp_path):
    a, b = pair

    async def truncated(stream, req):
        await stream.write(struct.pack(">I", 100) + b"\x93\x01\x2b")
        await stream.close()

    _serve_with(b, truncated)
    store = ShardStore.open(tmp_path)
    with trio.fail_after(10), pytest.raises(StreamClosed):
        await _fetch(a, b, store)
    _assert_clean(store, tmp_path)


async def test_oversized_header_is_refused_before_allocation(pair, tmp_path):
    a, b = pair

    async def huge(stream, req):
        await stream.write(struct.pack(">I", 2_000_000_000))
        await trio.sleep_forever()

    _serve_with(b, huge)
    store = ShardStore.open(tmp_path)
    with trio.fail_after(10), pytest.raises(OversizeError):
        await _fetch(a, b, store)
    _assert_clean(store, tmp_path)


async def test_header_that_disagrees_with_the_manifest_is_refused(pair, tmp_path):
    a, b = pair

    async def lying(stream, req):
        await send_message(stream, ShardHeader(manifest_id=MID, index=0, status=STATUS_OK, nbytes=len(DATA) * 2,
                                               sha256=SHA))
        await trio.sleep_forever()

    _serve_with(b, lying)
    store = ShardStore.open(tmp_path)
    with trio.fail_after(10), pytest.raises(IntegrityError):
        await _fetch(a, b, store)
    _assert_clean(store, tmp_path)


@pytest.mark.parametrize("body, error", [
    (DATA[:1000], IntegrityError),               # ends early
    (DATA + b"extra", OversizeError),            # more than announced (on /2: see test_bytes_past_the_body_...)
    (bytes([DATA[0] ^ 1]) + DATA[1:], IntegrityError),  # corrupted (a flipped bit: a written 0 may be DATA's own)
])
async def test_bad_body_is_rejected_and_nacked(pair, tmp_path, body, error):
    """/shoal/shard/1: one exchange, ended by the holder's half-close."""
    a, b = pair
    acks = []

    async def bad(stream, req):
        await send_message(stream, ShardHeader(manifest_id=MID, index=0, status=STATUS_OK, nbytes=len(DATA),
                                               sha256=SHA))
        try:
            await stream.write(body)
            await stream.close_write()
            acks.append(await stream.read(4096))
        except StreamClosed:
            acks.append(None)

    _serve_with(b, bad, transfer.SHARD_PROTOCOL_V1)
    store = ShardStore.open(tmp_path)
    with trio.fail_after(10), pytest.raises(error):
        await _fetch(a, b, store, protocol=transfer.SHARD_PROTOCOL_V1)
    _assert_clean(store, tmp_path)


async def test_silent_sender_hits_the_inactivity_deadline(pair, tmp_path):
    a, b = pair

    async def stall(stream, req):
        await send_message(stream, ShardHeader(manifest_id=MID, index=0, status=STATUS_OK, nbytes=len(DATA),
                                               sha256=SHA))
        await stream.write(DATA[:1000])
        await trio.sleep_forever()

    _serve_with(b, stall)
    store = ShardStore.open(tmp_path)
    start = trio.current_time()
    with trio.fail_after(10), pytest.raises(TransferTimeout):
        await _fetch(a, b, store)
    assert trio.current_time() - start < 2 * FAST.inactivity_s + 1
    _assert_clean(store, tmp_path)


async def test_sender_gives_up_on_a_receiver_that_stops_reading(pair, tmp_path):
    a, b = pair
    src = tmp_path / "src.bin"
    src.write_bytes(DATA)
    errors = []

    async def serve(stream, req):
        try:
            await transfer.send_shard(stream, req, source=src, sha256=SHA, nbytes=len(DATA), deadlines=FAST)
        except TransferTimeout as exc:
            errors.append(exc)

    _serve_with(b, serve)
    with trio.fail_after(10):
        stream = await a.open_stream(b.peer_id, transfer.SHARD_PROTOCOL)
        await send_message(stream, transfer.ShardRequest(manifest_id=MID, index=0, fallback=False))
        while not errors:  # never read: the window fills and the sender's write stalls
            await trio.sleep(0.01)
    assert isinstance(errors[0], TransferTimeout)


def test_a_shard_held_in_memory_goes_out_in_whole_chunks_whatever_its_pieces():
    data = bytes(range(256)) * (3 * transfer.CHUNK_BYTES // 256 + 7)
    cuts = [0, 5, 6, 4096, transfer.CHUNK_BYTES - 1, transfer.CHUNK_BYTES + 3, 2 * transfer.CHUNK_BYTES, len(data)]
    held = HeldShard(pieces=tuple(memoryview(data)[a:b] for a, b in zip(cuts, cuts[1:])), nbytes=len(data))
    chunks = list(transfer._chunks_of(held, len(data)))
    assert b"".join(chunks) == data
    assert [len(c) for c in chunks[:-1]] == [transfer.CHUNK_BYTES] * (len(chunks) - 1)


async def test_a_shard_held_in_memory_arrives_whole_after_the_store_let_it_go_mid_send(pair, tmp_path):
    # The pieces are raw views of tensor memory; the send must keep that memory alive by itself, or a state
    # released while a joiner fetches it would go out as whatever reused the freed memory.
    import gc

    import torch

    from node.shardcast.tensors import TensorParts
    a, b = pair
    sender = ShardStore.open(tmp_path / "sender")
    parts = TensorParts({"w": torch.frombuffer(bytearray(DATA), dtype=torch.uint8).clone()})
    sender.hold_in_memory(parts.pieces(0, parts.total_bytes), SHA, keep=parts)
    del parts

    async def send(stream, req):
        held = sender.held_in_memory(SHA)
        sender.drop_shard(SHA)
        gc.collect()
        litter = [torch.full((len(DATA),), 7, dtype=torch.uint8) for _ in range(8)]  # would take the freed memory
        result = await transfer.send_shard(stream, req, source=held, sha256=SHA, nbytes=len(DATA), deadlines=FAST)
        del litter
        return result

    sent = _serve_with(b, send)
    store = ShardStore.open(tmp_path / "store")
    with trio.fail_after(10):
        assert await _fetch(a, b, store) == STATUS_OK
        while not sent:
            await trio.sleep(0.005)
    assert store.read_shard(SHA) == DATA and sent[0].ok and not sender.has_shard(SHA)


# /shoal/shard/2: several exchanges on one stream

SHARDS = [os.urandom(70_000 + i) for i in range(3)]


def _serve_kept(host, *, answers=None, served=None):
    """A holder of SHARDS that answers requests on one stream until the receiver closes it, as the service does.
    ``answers``: per request, "ok" or a refusal status (default: all ok)."""
    answers = list(answers or [])

    async def handler(stream):
        req = await transfer.read_request(stream, FAST)
        while req is not None:
            served.append((id(stream), req.index)) if served is not None else None
            status = answers.pop(0) if answers else STATUS_OK
            if status != STATUS_OK:
                assert await transfer.refuse(stream, req, status, FAST)
            else:
                data = SHARDS[req.index]
                src = HeldShard(pieces=(data,), nbytes=len(data))
                result = await transfer.send_shard(stream, req, source=src, sha256=hashlib.sha256(data).digest(),
                                                   nbytes=len(data), deadlines=FAST)
                assert result.ok
            req = await transfer.read_next(stream, 5.0, transfer.CONTROL_MAX_BYTES, ShardRequest)
        await stream.close()

    host.set_stream_handler(transfer.SHARD_PROTOCOL, handler)


async def _ask(stream, store, index):
    data = SHARDS[index]
    return await transfer.fetch_shard(stream, store, manifest_id=MID, index=index,
                                      sha256=hashlib.sha256(data).digest(), nbytes=len(data), deadlines=FAST)


async def test_a_kept_stream_carries_several_exchanges_and_refusals(pair, tmp_path):
    a, b = pair
    served = []
    _serve_kept(b, answers=[STATUS_OK, STATUS_BUSY, STATUS_OK, STATUS_OK], served=served)
    store = ShardStore.open(tmp_path)
    with trio.fail_after(10):
        stream = await a.open_stream(b.peer_id, transfer.SHARD_PROTOCOLS)
        assert stream.protocol == transfer.SHARD_PROTOCOL and transfer.keeps_open(stream)
        assert await _ask(stream, store, 0) == STATUS_OK
        assert await _ask(stream, store, 1) == STATUS_BUSY  # a refusal leaves the stream open
        assert await _ask(stream, store, 1) == STATUS_OK
        assert await _ask(stream, store, 2) == STATUS_OK
    assert [store.read_shard(hashlib.sha256(d).digest()) for d in SHARDS] == SHARDS
    assert [i for _, i in served] == [0, 1, 1, 2] and len({sid for sid, _ in served}) == 1


async def test_an_older_holder_is_asked_on_shard_1(pair, tmp_path):
    a, b = pair
    src = tmp_path / "src.bin"
    src.write_bytes(DATA)
    _serve_with(b, lambda s, r: transfer.send_shard(s, r, source=src, sha256=SHA, nbytes=len(DATA),
                                                   deadlines=FAST), transfer.SHARD_PROTOCOL_V1)
    store = ShardStore.open(tmp_path / "store")
    with trio.fail_after(10):
        stream = await a.open_stream(b.peer_id, transfer.SHARD_PROTOCOLS)
        assert stream.protocol == transfer.SHARD_PROTOCOL_V1 and not transfer.keeps_open(stream)
        assert await transfer.fetch_shard(stream, store, manifest_id=MID, index=0, sha256=SHA, nbytes=len(DATA),
                                          deadlines=FAST) == STATUS_OK
    assert store.read_shard(SHA) == DATA


async def test_bytes_past_the_body_are_refused_as_the_next_header(pair, tmp_path):
    """On /2 the header's count ends the body: what a holder sends past it is read as its next answer, and refused."""
    a, b = pair
    data = SHARDS[0]

    async def padded(stream):
        await transfer.read_request(stream, FAST)
        await send_message(stream, ShardHeader(manifest_id=MID, index=0, status=STATUS_OK, nbytes=len(data),
                                               sha256=hashlib.sha256(data).digest()))
        await stream.write(data + b"\xff" * 64)
        await trio.sleep_forever()

    b.set_stream_handler(transfer.SHARD_PROTOCOL, padded)
    store = ShardStore.open(tmp_path)
    with trio.fail_after(10):
        stream = await a.open_stream(b.peer_id, transfer.SHARD_PROTOCOL)
        assert await _ask(stream, store, 0) == STATUS_OK  # the shard itself is whole and verified
        with pytest.raises(RemoteProtocolError):
            await _ask(stream, store, 1)


async def test_a_kept_stream_the_holder_closed_fails_unanswered(pair, tmp_path):
    """What the fetcher retries on a new stream, charging nobody: no answer at all, not a bad one."""
    a, b = pair

    async def once(stream):
        req = await transfer.read_request(stream, FAST)
        data = SHARDS[req.index]
        await transfer.send_shard(stream, req, source=HeldShard(pieces=(data,), nbytes=len(data)),
                                  sha256=hashlib.sha256(data).digest(), nbytes=len(data), deadlines=FAST)
        await stream.close()  # idle past its wait: the holder ends the stream

    b.set_stream_handler(transfer.SHARD_PROTOCOL, once)
    store = ShardStore.open(tmp_path)
    with trio.fail_after(10):
        stream = await a.open_stream(b.peer_id, transfer.SHARD_PROTOCOL)
        assert await _ask(stream, store, 0) == STATUS_OK
        await trio.sleep(0.1)
        with pytest.raises(transfer.Unanswered):
            await _ask(stream, store, 1)


async def test_the_holder_waits_for_the_next_request_only_so_long(pair):
    """read_next on a kept shard stream: None at the receiver's clean EOF and after idle_s; charged refusals
    for junk."""
    a, b = pair
    got = []

    async def handler(stream):
        got.append(await transfer.read_next(stream, 0.3, transfer.CONTROL_MAX_BYTES, ShardRequest))

    b.set_stream_handler(transfer.SHARD_PROTOCOL, handler)
    with trio.fail_after(10):
        idle = await a.open_stream(b.peer_id, transfer.SHARD_PROTOCOL)
        closed = await a.open_stream(b.peer_id, transfer.SHARD_PROTOCOL)
        await closed.close_write()
        while len(got) < 2:
            await trio.sleep(0.01)
    assert got == [None, None]
    del idle

    refusals = []

    async def judged(stream):
        try:
            await transfer.read_next(stream, 5.0, transfer.CONTROL_MAX_BYTES, ShardRequest)
        except transfer.Refused as exc:
            refusals.append((exc.reason, exc.charge))

    b.set_stream_handler(transfer.SHARD_PROTOCOL, judged)
    with trio.fail_after(10):
        for payload in (struct.pack(">I", 64) + os.urandom(64), b"\xff\xff\xff\xff", struct.pack(">I", 100) + b"\x93"):
            stream = await a.open_stream(b.peer_id, transfer.SHARD_PROTOCOL)
            await stream.write(payload)
            await stream.close_write()
        while len(refusals) < 3:
            await trio.sleep(0.01)
    assert sorted(refusals) == [("garbage", True), ("oversize", True), ("truncated", True)]
