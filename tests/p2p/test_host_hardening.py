"""What only the libp2p host must guard against: weak dialers, silent peers, lost connections, mDNS threads."""

from __future__ import annotations

import functools
import threading
from contextlib import AsyncExitStack

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID, Transport as NoiseTransport
from libp2p.crypto.x25519 import create_new_key_pair as x25519_key_pair
from libp2p.stream_muxer.mplex.mplex import MPLEX_PROTOCOL_ID, Mplex
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID, Yamux

from p2p.host import _thread_forwarder, open_host
from p2p_harness import connect, fresh_keypair, make_config, wait_until
from protocol.errors import PeerUnreachable, StreamClosed


def _weak_dialer(kind: str):
    key_pair = create_new_key_pair()
    if kind == "plaintext":
        sec_opt = {PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)}
        muxer_opt = {TProtocol(YAMUX_ID): Yamux}
    else:  # noise, but only the mplex muxer
        sec_opt = {NOISE_ID: NoiseTransport(key_pair, noise_privkey=x25519_key_pair().private_key)}
        muxer_opt = {TProtocol(MPLEX_PROTOCOL_ID): Mplex}
    return new_host(key_pair=key_pair, sec_opt=sec_opt, muxer_opt=muxer_opt,
                    connection_config=ConnectionConfig(max_connections_per_peer=1, dial_timeout=3.0))


@pytest.mark.parametrize("kind", ["plaintext", "mplex-only"])
async def test_a_dialer_without_noise_and_yamux_cannot_connect(kind):
    with trio.fail_after(30):
        async with open_host(fresh_keypair(), make_config()) as ours:
            dialer = _weak_dialer(kind)
            async with dialer.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                with pytest.raises(Exception):
                    with trio.fail_after(10):
                        await dialer.connect(info_from_p2p_addr(multiaddr.Multiaddr(ours.listen_addrs()[0])))
                assert ours.connected_peers() == []
                await dialer.close()


async def test_a_silent_tcp_peer_times_out_as_peer_unreachable():
    """A listener that accepts but never speaks multistream: the dial must end at dial_timeout_s."""
    accepted = []

    async def hold_open(conn):
        accepted.append(conn)
        await trio.sleep_forever()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, hold_open, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            fake_id = fresh_keypair().peer_id
            async with open_host(fresh_keypair(), make_config(dial_timeout_s=1.0)) as ours:
                started = trio.current_time()
                with pytest.raises(PeerUnreachable):
                    await ours.connect(f"/ip4/127.0.0.1/tcp/{port}/p2p/{fake_id}")
                assert trio.current_time() - started < 5.0
                assert accepted  # the dial reached the silent listener and was cut by our deadline
            nursery.cancel_scope.cancel()


async def test_a_peer_host_that_vanishes_mid_stream_is_stream_closed_not_eof():
    got = []
    reading = trio.Event()

    async def slow_reader(stream):
        reading.set()
        try:
            while await stream.read(1024):
                pass
            got.append("eof")
        except StreamClosed:
            got.append("closed")

    with trio.fail_after(30):
        async with open_host(fresh_keypair(), make_config()) as b:
            b.set_stream_handler("/hold/1", slow_reader)
            async with AsyncExitStack() as stack:
                a = await stack.enter_async_context(open_host(fresh_keypair(), make_config()))
                await connect(a, b)
                stream = await a.open_stream(b.peer_id, "/hold/1")
                await stream.write(b"partial frame")
                await reading.wait()
            # a's host is gone without closing the stream: b must not mistake that for a clean end.
            await wait_until(lambda: got != [], timeout_s=10)
            assert got == ["closed"]


async def test_mdns_callbacks_from_foreign_threads_reach_discovered_and_skip_ourselves():
    with trio.fail_after(20):
        async with open_host(fresh_keypair(), make_config()) as ours:
            forward = _thread_forwarder(ours, trio.lowlevel.current_trio_token())
            other_id = fresh_keypair().peer_id
            mine = PeerInfo(ID.from_base58(ours.peer_id), [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/1")])
            # py-libp2p's mDNS advertises a 0.0.0.0 listen address as it is: dialled, it would reach us.
            theirs = PeerInfo(ID.from_base58(other_id), [multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4242"),
                                                         multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4242")])

            def zeroconf_thread():
                forward(mine)
                forward(theirs)

            thread = threading.Thread(target=zeroconf_thread)
            thread.start()
            await trio.to_thread.run_sync(thread.join)
            assert await ours.discovered().receive() == f"/ip4/127.0.0.1/tcp/4242/p2p/{other_id}"
            with pytest.raises(trio.WouldBlock):
                ours.discovered().receive_nowait()


async def test_publish_refuses_payloads_over_max_gossip_bytes(swarm):
    with trio.fail_after(20):
        async with swarm.hosts(1, config=make_config(max_gossip_bytes=1024)) as (a,):
            with pytest.raises(ValueError):
                await a.publish("t", b"x" * 1025)


async def test_a_restarted_host_with_the_same_key_is_heard_at_once_after_a_burst_of_gossip():
    # Gossip message ids are the publisher's id and a sequence number. py-libp2p starts the number at
    # the clock's seconds and counts one per message, so a node that published more than one message a
    # second and restarts reuses numbers its previous incarnation sent: its peers drop its new messages
    # as already seen (for the seen cache's two minutes), and mark it dead while it answers hellos.
    topic = "shoal-test/restart"
    keypair = fresh_keypair()
    with trio.fail_after(60):
        async with open_host(fresh_keypair(), make_config()) as a:
            received = a.subscribe(topic, None)
            for incarnation in range(2):
                async with open_host(keypair, make_config()) as b:
                    b.subscribe(topic, None)
                    await connect(b, a)
                    await a.wait_for_topic_peer(topic, b.peer_id)
                    await b.wait_for_topic_peer(topic, a.peer_id)
                    for i in range(50):
                        body = f"{incarnation}:{i}".encode()
                        with trio.fail_after(10):
                            while True:  # until the mesh takes b in: later messages go straight through
                                await b.publish(topic, body)
                                with trio.move_on_after(0.5 if i == 0 else 5.0):
                                    while (await received.receive()).data != body:
                                        pass
                                    break
                await wait_until(lambda: b.peer_id not in a.connected_peers(), timeout_s=10)


async def test_banning_a_peer_we_gossip_with_leaves_our_gossip_running():
    # py-libp2p's blacklist teardown resets the banned peer's pubsub stream and then deletes it from
    # its peer table without looking; the disconnect that follows a ban removes it first, and the
    # KeyError ended the Pubsub service: banning any gossiping peer stopped the node.
    topic = "shoal-test/ban"
    with trio.fail_after(60):
        async with open_host(fresh_keypair(), make_config()) as a, \
                open_host(fresh_keypair(), make_config()) as evil, \
                open_host(fresh_keypair(), make_config()) as c:
            received = c.subscribe(topic, None)
            for h in (a, evil):
                h.subscribe(topic, None)
            await connect(evil, a)
            await connect(c, a)
            await a.wait_for_topic_peer(topic, evil.peer_id)
            await a.wait_for_topic_peer(topic, c.peer_id)
            await a.block_peer(evil.peer_id, 300)
            await wait_until(lambda: evil.peer_id not in a.connected_peers(), timeout_s=10)
            await trio.sleep(0.5)  # the teardown task has run
            with trio.fail_after(10):
                while True:
                    await a.publish(topic, b"still here")
                    with trio.move_on_after(0.5):
                        assert (await received.receive()).data == b"still here"
                        break


async def test_the_blacklist_teardown_survives_the_peer_being_dropped_while_its_stream_resets():
    # The interleaving the node hit (the test above may not): the peer leaves pubsub's table while the
    # teardown awaits the stream's reset.
    async with open_host(fresh_keypair(), make_config()) as a:
        pubsub = a._pubsub
        pid = ID.from_base58(fresh_keypair().peer_id)

        class SlowStream:
            async def reset(self):
                await trio.sleep(0.05)

        pubsub.peers[pid] = SlowStream()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pubsub._teardown_if_connected, pid)
            await trio.sleep(0.01)
            del pubsub.peers[pid]  # the disconnect got there first
        assert pid not in pubsub.peers


def test_yamux_credit_is_batched_unless_the_operator_says_otherwise(monkeypatch):
    from p2p.wire import YAMUX_RELEASE_ON_READ, batch_window_updates
    from libp2p.stream_muxer.yamux import yamux

    monkeypatch.delenv(YAMUX_RELEASE_ON_READ, raising=False)
    batch_window_updates()
    assert yamux._yamux_release_on_read() is False  # the library's own switch, read at call time
    monkeypatch.setenv(YAMUX_RELEASE_ON_READ, "1")
    batch_window_updates()
    assert yamux._yamux_release_on_read() is True
