"""A hostile peer on real libp2p: junk gossip, forged and oversized announcements, floods and broken frames.

The node must keep running and serving honest peers, count every drop by reason, and ban the offender.
"""

import struct

import trio

from node.control import ControlClient
from node.membership import ANNOUNCE_TOPIC, HELLO_PROTOCOL, MAX_ANNOUNCE_BYTES
from p2p.api import HostConfig
from p2p.framing import write_frame
from p2p.host import open_host
from protocol.codec import encode
from protocol.envelope import Envelope, seal
from protocol.errors import TransportError
from protocol.keys import Keypair
from protocol.messages import Announce, HardwareSummary
from tests.node.conftest import fast_config, start_node, wait_until

HW = HardwareSummary(devices=("cpu",), memory_bytes=1, tflops=0.1)


def announce(peer_id, seq=1, **kw):
    return Announce(peer_id=peer_id, seq=seq, addrs=(), version="evil", roles=(), hardware=HW, **kw)


async def hostile_hello(host, peer_id, payload: bytes) -> None:
    """Open a hello stream, send raw bytes, and see what happens (reset or close)."""
    try:
        with trio.move_on_after(3):
            stream = await host.open_stream(peer_id, HELLO_PROTOCOL)
            await stream.write(payload)
            await stream.close_write()
            await stream.read(1024)
    except TransportError:
        pass


async def connect_to_topic(host, node) -> None:
    await host.connect(node.host.listen_addrs()[0])
    with trio.fail_after(10):
        await host.wait_for_topic_peer(ANNOUNCE_TOPIC, node.keypair.peer_id)


async def test_hostile_peer_does_not_stop_the_node(tmp_path):
    evil_key, victim_key, flood_key = (Keypair.from_label(x) for x in ("evil", "victim", "flood"))
    async with trio.open_nursery() as nursery:
        # Slow heartbeats and a low flood limit keep the verdicts independent of how loaded the CPU is:
        # an honest peer sends 1 announcement/s, the flooder hundreds as fast as it can.
        calm = dict(heartbeat_interval_s=1.0, suspect_after_s=4.0, dead_after_s=8.0, gossip_rate_per_s=3.0,
                    gossip_burst=6)
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", **calm))
        honest, _ = await start_node(nursery, fast_config(tmp_path / "honest", bootstrap=node.host.listen_addrs(),
                                                          **calm))
        node_id, honest_id = node.keypair.peer_id, honest.keypair.peer_id
        await wait_until(lambda: node.membership.table.alive() == [honest_id], timeout_s=20)

        async with open_host(evil_key, HostConfig(listen_addrs=["/ip4/127.0.0.1/tcp/0"])) as evil:
            await connect_to_topic(evil, node)
            # Broken frames on a stream protocol: garbage, a length prefix of 4 GiB, a truncated frame.
            await hostile_hello(evil, node_id, b"\x00\x00\x00\x05hello")
            await hostile_hello(evil, node_id, struct.pack(">I", 0xFFFFFFF0) + b"x" * 100)
            await hostile_hello(evil, node_id, struct.pack(">I", 1000) + b"short")
            # Gossip junk: not msgpack, a forged signature, an oversized message, an impersonation.
            env = Envelope(signer=evil_key.public_key, payload=encode(announce(evil_key.peer_id, seq=2)),
                           signature=bytes(64))
            for data in (b"\xc1 not msgpack", encode(env), b"\x00" * (MAX_ANNOUNCE_BYTES + 1),
                         seal(announce(victim_key.peer_id), evil_key)):
                await evil.publish(ANNOUNCE_TOPIC, data)
            await wait_until(lambda: node.membership.is_banned(evil_key.peer_id), timeout_s=20)
            await wait_until(lambda: evil_key.peer_id not in node.host.connected_peers(), timeout_s=20)

        # A flood of validly signed announcements, far above the per-origin rate limit.
        async with open_host(flood_key, HostConfig(listen_addrs=["/ip4/127.0.0.1/tcp/0"])) as flooder:
            await connect_to_topic(flooder, node)
            for seq in range(1, 301):
                await flooder.publish(ANNOUNCE_TOPIC, seal(announce(flood_key.peer_id, seq=seq), flood_key))
            await wait_until(lambda: node.membership.is_banned(flood_key.peer_id), timeout_s=20)

        drops = node.traffic.drops
        for reason in ("malformed", "bad_signature", "oversize", "impersonation", "flood"):
            assert drops[reason] >= 1, (reason, dict(drops))
        # Still serving the honest peer, and still serving its control API.
        # The honest peer is still alive after a full dead-after period without the attackers.
        await trio.sleep(node.config.dead_after_s)
        assert node.membership.table.alive() == sorted([honest_id])
        assert victim_key.peer_id not in node.membership.table.peers
        client = ControlClient(token=node.control_token, url=node.control_url)
        metrics = await trio.to_thread.run_sync(client.text, "/metrics")
        assert 'shoal_messages_dropped_total{reason="bad_signature"}' in metrics
        assert "shoal_banned_peers 2.0" in metrics
        status = await trio.to_thread.run_sync(client.call, "/status")
        assert evil_key.peer_id in status["banned_peers"]
        nursery.cancel_scope.cancel()
