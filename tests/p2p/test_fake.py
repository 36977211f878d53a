"""The fake's own features: backpressure, fault injection (partition, heal, kill) and simulated mDNS."""

from __future__ import annotations

import pytest
import trio

from p2p.fake import FakeNetwork
from p2p_harness import fresh_keypair, make_config
from protocol.errors import PeerUnreachable, StreamClosed


async def test_a_writer_blocks_when_the_reader_does_not_read():
    network = FakeNetwork(stream_buffer_bytes=1024)
    release = trio.Event()

    async def lazy(stream):
        await release.wait()
        while await stream.read(4096):
            pass

    with trio.fail_after(10):
        async with network.open_host(fresh_keypair()) as a, network.open_host(fresh_keypair()) as b:
            b.set_stream_handler("/lazy", lazy)
            await a.connect(b.listen_addrs()[0])
            stream = await a.open_stream(b.peer_id, "/lazy")
            await stream.write(b"x" * 1024)  # exactly fills the buffer
            with trio.move_on_after(0.05) as blocked:
                await stream.write(b"y")
            assert blocked.cancelled_caught
            release.set()
            await stream.write(b"z" * 10_000)  # drains once the reader reads
            await stream.close_write()


async def test_partition_cuts_the_link_and_refuses_dials_until_healed():
    network = FakeNetwork()
    with trio.fail_after(10):
        async with network.open_host(fresh_keypair()) as a, network.open_host(fresh_keypair()) as b:
            b.set_stream_handler("/hold", lambda s: trio.sleep_forever())
            await a.connect(b.listen_addrs()[0])
            stream = await a.open_stream(b.peer_id, "/hold")
            network.partition(a.peer_id, b.peer_id)
            assert a.connected_peers() == [] and b.connected_peers() == []
            with pytest.raises(StreamClosed):
                await stream.read(10)
            with pytest.raises(PeerUnreachable):
                await a.connect(b.listen_addrs()[0])
            network.heal(a.peer_id, b.peer_id)
            assert await a.connect(b.listen_addrs()[0]) == b.peer_id


async def test_kill_drops_a_host_like_sigkill():
    network = FakeNetwork()
    with trio.fail_after(10):
        async with network.open_host(fresh_keypair()) as a, network.open_host(fresh_keypair()) as b:
            b.set_stream_handler("/hold", lambda s: trio.sleep_forever())
            await a.connect(b.listen_addrs()[0])
            stream = await a.open_stream(b.peer_id, "/hold")
            await stream.write(b"unread data is lost")
            network.kill(b.peer_id)
            with pytest.raises(StreamClosed):
                await stream.read(10)
            with pytest.raises(PeerUnreachable):
                await a.connect(b.listen_addrs()[0])
            assert a.connected_peers() == []


async def test_mdns_hosts_discover_each_other():
    network = FakeNetwork()
    config = make_config(mdns=True)
    with trio.fail_after(10):
        async with network.open_host(fresh_keypair(), config) as a, network.open_host(fresh_keypair(), config) as b:
            assert await a.discovered().receive() == b.listen_addrs()[0]
            assert await b.discovered().receive() == a.listen_addrs()[0]


async def test_gossip_does_not_cross_a_host_that_is_not_subscribed():
    """As in gossipsub, only subscribers relay: A - X - C with X unsubscribed delivers nothing to C."""
    network = FakeNetwork()
    with trio.fail_after(10):
        async with network.open_host(fresh_keypair()) as a, network.open_host(fresh_keypair()) as x, \
                network.open_host(fresh_keypair()) as c:
            rc = c.subscribe("t")
            await a.connect(x.listen_addrs()[0])
            await x.connect(c.listen_addrs()[0])
            await a.publish("t", b"lost")
            with pytest.raises(trio.WouldBlock):
                rc.receive_nowait()
