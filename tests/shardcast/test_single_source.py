"""Single-source mode, the benchmark baseline: receivers pull only from the publisher, which serves duplicates."""

from __future__ import annotations

import os

import trio

from protocol.manifest import manifest_id

from node.shardcast import TOPIC, ShardcastConfig
from tests.shardcast.conftest import FAST

SINGLE = ShardcastConfig(**{**FAST, "single_source": True, "max_uploads": 16})


async def _mesh_ready(nodes):
    for a in nodes:
        for b in nodes:
            if a is not b:
                await a.host.wait_for_topic_peer(TOPIC, b.peer_id)


async def test_concurrent_receivers_each_pull_everything_from_the_publisher(swarm, tmp_path):
    pub = await swarm.add("pub", config=SINGLE)
    rxs = [await swarm.add(f"rx{i}", config=SINGLE) for i in range(3)]
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(16 * 16 * 1024))  # 16 shards of 16 KiB
    with trio.fail_after(30):
        await _mesh_ready([pub, *rxs])
        m = await pub.service.publish_file(src)
        async with trio.open_nursery() as n:
            for r in rxs:
                n.start_soon(r.service.fetch, manifest_id(m))
    for r in rxs:
        assert r.service.statistics().bytes_fetched_by_peer == {pub.peer_id: m.total_bytes}
        out = tmp_path / f"{r.name}.bin"
        r.service.export_file(m, out)
        assert out.read_bytes() == src.read_bytes()
    stats = pub.service.statistics()
    assert stats.bytes_served == 3 * m.total_bytes
    # Serve-once seeding would have refused the concurrent duplicates as "busy".
    assert stats.uploads_refused_busy == 0


async def test_receiver_ignores_a_complete_non_publisher_holder(swarm, tmp_path):
    # A super-seeding publisher would send "late" to "early"; a single-source one serves duplicates.
    pub = await swarm.add("pub", config=SINGLE)
    early = await swarm.add("early")
    late = await swarm.add("late", config=SINGLE)
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(8 * 16 * 1024))
    with trio.fail_after(30):
        await _mesh_ready([pub, early, late])
        m = await pub.service.publish_file(src)
        await early.service.fetch(manifest_id(m))
        await late.service.fetch(manifest_id(m))
    assert late.service.statistics().bytes_fetched_by_peer == {pub.peer_id: m.total_bytes}
    assert early.service.statistics().bytes_served == 0
