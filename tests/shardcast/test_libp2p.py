"""Shardcast over real libp2p hosts (TCP + Noise + Yamux) on 127.0.0.1."""

from __future__ import annotations

import os
from contextlib import AsyncExitStack

import pytest
import trio

from p2p.api import HostConfig
from p2p.host import open_host
from protocol.keys import Keypair
from protocol.manifest import manifest_id

from node.shardcast import TOPIC, ShardcastConfig, ShardcastService, ShardStore

pytestmark = pytest.mark.slow


async def test_publish_and_fetch_over_libp2p(tmp_path):
    cfg = ShardcastConfig(shard_bytes=1 << 20, have_interval_s=0.02, busy_retry_s=0.3, query_interval_s=0.5,
                          stall_timeout_s=30.0)
    data = os.urandom(12 << 20)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    # Services stop (the inner nursery) before their hosts close (the stack), as in the daemon.
    async with AsyncExitStack() as stack:
        hosts = []
        for name in ("pub", "rx0", "rx1"):
            kp = Keypair.from_label(name)
            hosts.append((kp, await stack.enter_async_context(
                open_host(kp, HostConfig(listen_addrs=["/ip4/127.0.0.1/tcp/0"])))))
        nursery = await stack.enter_async_context(trio.open_nursery())
        nodes = []
        for kp, host in hosts:
            svc = ShardcastService(host, kp, ShardStore.open(tmp_path / kp.peer_id[-8:]), config=cfg)
            await nursery.start(svc.run)
            nodes.append((host, svc))
        (pub_host, pub), (h0, rx0), (h1, rx1) = nodes
        with trio.fail_after(60):
            for h in (h0, h1):
                await h.connect(pub_host.listen_addrs()[0])
            await h1.connect(h0.listen_addrs()[0])
            m = await pub.publish_file(src)
            mid = manifest_id(m)
            start = trio.current_time()
            # rx0 may miss the manifest gossip (subscriptions still propagating): fetch by id covers it.
            got0 = await rx0.fetch(mid)
            one_s = trio.current_time() - start
            for h in (h0, h1):
                await h.wait_for_topic_peer(TOPIC, h0.peer_id if h is h1 else h1.peer_id)
            got1 = await rx1.fetch(mid)
        print(f"\nlibp2p: 1 receiver fetched {len(data) / 1e6:.1f} MB in {one_s:.2f} s "
              f"= {len(data) / 1e6 / one_s:.1f} MB/s")
        for svc, got, name in ((rx0, got0, "a"), (rx1, got1, "b")):
            out = tmp_path / f"{name}.bin"
            svc.export_file(got, out)
            assert out.read_bytes() == data
        assert rx1.statistics().bytes_fetched_by_peer.get(h0.peer_id, 0) > 0, "rx1 should use rx0 as a source"
        assert pub.statistics().bytes_served <= 1.5 * len(data)
        nursery.cancel_scope.cancel()
