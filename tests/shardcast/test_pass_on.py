"""Cut-through: a shard still arriving at one receiver is passed on to another, its last bytes only once verified."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from p2p.framing import send_message
from protocol.codec import decode, encode
from protocol.manifest import STATUS_BUSY, STATUS_OK, Have, ShardHeader, bitfield_from_indices, manifest_id

from node.shardcast import TOPIC, ShardcastConfig, transfer
from node.shardcast.incoming import MAX_PASS_ON_BYTES, IncomingShards, UpstreamFailed
from tests.shardcast.conftest import FAST, wait_until

SHARD = 64 * 1024
PIECE = 8 * 1024
MID = bytes(32)


# the bookkeeping, alone

async def _followed(incoming) -> tuple[list[bytes], BaseException | None]:
    got: list[bytes] = []
    try:
        async for chunk in incoming.follow():
            got.append(chunk)
    except UpstreamFailed as exc:
        return got, exc
    return got, None


async def test_a_follower_gets_every_chunk_but_the_last_until_the_shard_verifies():
    shards = IncomingShards()
    inc = shards.begin(MID, 0, 3 * PIECE)
    results = []
    async with trio.open_nursery() as nursery:
        async def follow():
            results.append(await _followed(inc))

        nursery.start_soon(follow)
        await trio.testing.wait_all_tasks_blocked()
        inc.add(b"a" * PIECE)
        inc.add(b"b" * PIECE)
        inc.add(b"c" * PIECE)  # every byte is here, but unverified: the last chunk waits
        await trio.testing.wait_all_tasks_blocked()
        assert not results
        shards.end(inc, ok=True)
    (got, error), = results
    assert error is None and got == [b"a" * PIECE, b"b" * PIECE, b"c" * PIECE]
    assert shards.get(MID, 0) is None


async def test_a_follower_is_failed_when_the_shard_does_not_verify():
    shards = IncomingShards()
    inc = shards.begin(MID, 0, 2 * PIECE)
    results = []
    async with trio.open_nursery() as nursery:
        async def follow():
            results.append(await _followed(inc))

        nursery.start_soon(follow)
        inc.add(b"a" * PIECE)
        inc.add(b"b" * PIECE)
        await trio.testing.wait_all_tasks_blocked()
        shards.end(inc, ok=False)
    (got, error), = results
    assert got == [b"a" * PIECE] and isinstance(error, UpstreamFailed)


def test_the_registry_passes_on_one_transfer_per_shard_and_no_large_shards():
    changed = []
    shards = IncomingShards(on_change=changed.append)
    first = shards.begin(MID, 3, PIECE)
    assert first is not None and shards.begin(MID, 3, PIECE) is None, "a hedge's twin is not registered"
    assert shards.begin(MID, 4, MAX_PASS_ON_BYTES + 1) is None
    assert shards.indices(MID) == {3} and changed == [MID]
    shards.end(first, ok=True)
    assert shards.indices(MID) == set() and changed == [MID, MID]


def test_a_have_without_arriving_shards_encodes_as_before_and_a_bad_arriving_field_is_refused():
    plain = Have(manifest_id=MID, num_shards=10, bitfield=bitfield_from_indices(10, {1, 2}))
    assert decode(encode(plain)) == plain
    with_arriving = Have(manifest_id=MID, num_shards=10, bitfield=plain.bitfield,
                         arriving=bitfield_from_indices(10, {5}))
    assert decode(encode(with_arriving)) == with_arriving
    assert len(encode(with_arriving)) > len(encode(plain))
    with pytest.raises(ValueError):
        Have(manifest_id=MID, num_shards=10, bitfield=plain.bitfield, arriving=b"\x00")


# through the service, on the fake network

async def _mesh_ready(nodes):
    for a in nodes:
        for b in nodes:
            if a is not b:
                await a.host.wait_for_topic_peer(TOPIC, b.peer_id)


def _dripping_publisher(pub, m, data: bytes, *, only_to: str, release: trio.Event, corrupt_first: bool = False):
    """pub's shard handler: to ``only_to``, the shard in PIECE pieces, holding the last one until ``release``; to
    anyone else "busy". With ``corrupt_first``, the first copy ends in garbage, and after it anyone is served."""
    mid = manifest_id(m)
    sent_corrupt = []

    async def serve(stream):
        req = await transfer.read_request(stream, transfer.Deadlines())
        if stream.remote_peer != only_to and not sent_corrupt:
            await send_message(stream, ShardHeader(manifest_id=mid, index=req.index, status=STATUS_BUSY,
                                                   nbytes=0, sha256=b""))
            await stream.close()
            return
        await send_message(stream, ShardHeader(manifest_id=mid, index=req.index, status=STATUS_OK,
                                               nbytes=len(data), sha256=m.shard_hashes[req.index]))
        corrupt = corrupt_first and not sent_corrupt
        body = data[:-PIECE] + os.urandom(PIECE) if corrupt else data
        for start in range(0, len(body) - PIECE, PIECE):
            await stream.write(body[start:start + PIECE])
            await trio.sleep(0.01)
        await release.wait()
        await stream.write(body[-PIECE:])
        if corrupt:
            sent_corrupt.append(True)
        await stream.close_write()
        await stream.read(1024)

    pub.host.set_stream_handler(transfer.SHARD_PROTOCOL, serve)
    return sent_corrupt


async def _pass_on(swarm, tmp_path, *, corrupt_first: bool):
    """pub drips one shard to ``first`` only; ``second`` fetches it from ``first`` while it arrives. Checks, before
    the last piece is released, that everything but the last chunk went on and nothing is stored yet; returns the
    nodes and whether a corrupt first copy was sent, once both fetches ended with the shard's bytes."""
    cfg = ShardcastConfig(**{**FAST, "shard_bytes": SHARD})
    pub = await swarm.add("pub", config=cfg)
    first = await swarm.add("first", config=cfg)
    second = await swarm.add("second", config=cfg)
    data = os.urandom(SHARD)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    release = trio.Event()
    got = {}
    with trio.fail_after(30):
        await _mesh_ready([pub, first, second])
        m = await pub.service.publish_file(src)
        mid = manifest_id(m)
        corrupted = _dripping_publisher(pub, m, data, only_to=first.peer_id, release=release,
                                        corrupt_first=corrupt_first)
        async with trio.open_nursery() as nursery:
            async def fetch(node):
                got[node.name] = await node.service.fetch(mid)

            nursery.start_soon(fetch, first)
            # The second learns from the first's Have that the shard is on its way there, and asks it.
            await wait_until(lambda: 0 in second.service.sources(mid).get(first.peer_id, set()))
            assert 0 not in second.service.holders(mid).get(first.peer_id, set()), "arriving is not held"
            nursery.start_soon(fetch, second)
            # Everything the first has received goes on, but not the last chunk: nothing verified it yet.
            await wait_until(lambda: first.service.statistics().bytes_served == SHARD - PIECE)
            assert not second.store.held_indices(mid) and not first.store.held_indices(mid)
            release.set()
    for node in (first, second):
        out = tmp_path / f"{node.name}.bin"
        node.service.export_file(got[node.name], out)
        assert out.read_bytes() == data
    return pub, first, second, corrupted


async def test_a_receiver_passes_a_shard_on_while_it_arrives_and_completes_it_once_verified(swarm, tmp_path):
    pub, first, second, _ = await _pass_on(swarm, tmp_path, corrupt_first=False)
    assert first.service.statistics().uploads_passed_on == 1
    assert second.service.statistics().bytes_fetched_by_peer == {first.peer_id: SHARD}
    assert not first.penalties and not second.penalties


async def test_a_shard_that_fails_its_hash_on_the_way_in_is_never_completed_downstream(swarm, tmp_path):
    # The first copy's last piece is garbage: the first refuses it (and drops the publisher for this fetch), the
    # second's transfer from it is reset; the second fetches from the publisher, the first then from the second.
    pub, first, second, corrupted = await _pass_on(swarm, tmp_path, corrupt_first=True)
    assert corrupted
    assert (pub.peer_id, "bad_hash") in first.penalties
    assert not second.penalties, "a reset passed-on transfer is nobody's fault the second can see"
    assert first.service.statistics().upload_failures >= 1
    assert second.service.statistics().shards_rejected == {}
