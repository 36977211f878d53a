"""Hostile input through py-libp2p's own handlers (pubsub, identify, the muxer) on real hosts.

For each case the node must stay up, keep an honest peer alive in both directions, and count the
event by reason; offences a peer can be blamed for are charged to it.
"""

from __future__ import annotations

import pytest
import trio

from node.membership import ANNOUNCE_TOPIC
from p2p.guards import MAX_INBOUND_STREAMS_PER_PEER
from tests.node.conftest import fast_config, start_node, wait_until
from p2p.rawpeer import (IDENTIFY_PUSH, MESHSUB, HostilePeer, RawPeerSession, garbage, multistream_line,
                         rpc_bytes, varint)

PING = "/ipfs/ping/1.0.0"
CALM = dict(heartbeat_interval_s=0.5, suspect_after_s=2.5, dead_after_s=4.0)


async def _rpc_random(evil: HostilePeer) -> None:
    await evil.send(MESHSUB, varint(300) + garbage(300))


async def _rpc_truncated(evil: HostilePeer) -> None:
    await evil.send(MESHSUB, varint(1000) + b"x" * 10)


async def _rpc_huge_length(evil: HostilePeer) -> None:
    await evil.send(MESHSUB, varint(1 << 40) + b"x" * 10)


async def _rpc_bad_varint(evil: HostilePeer) -> None:
    await evil.send(MESHSUB, b"\xff" * 12)


async def _rpc_forged_message(evil: HostilePeer) -> None:
    forged = dict(from_id=garbage(38), data=b"junk", seqno=b"\x00" * 8, topicIDs=[ANNOUNCE_TOPIC],
                  signature=garbage(64))
    await evil.send(MESHSUB, rpc_bytes(subscribe=[ANNOUNCE_TOPIC], publish=[forged]))


async def _rpc_unsigned_message(evil: HostilePeer) -> None:
    unsigned = dict(from_id=evil.host.get_id().to_bytes(), data=b"junk", seqno=b"\x00" * 8,
                    topicIDs=[ANNOUNCE_TOPIC])
    await evil.send(MESHSUB, rpc_bytes(publish=[unsigned]))


async def _rpc_control_flood(evil: HostilePeer) -> None:
    await evil.send(MESHSUB, rpc_bytes(ihave=(ANNOUNCE_TOPIC, [garbage(20) for _ in range(5000)])))


async def _identify_push_garbage(evil: HostilePeer) -> None:
    await evil.send(IDENTIFY_PUSH, varint(300) + garbage(300))


async def _negotiation_garbage(evil: HostilePeer) -> None:
    await evil.send(MESHSUB, b"")  # a normal open, so the connection exists
    stream_opened = False
    try:
        with trio.move_on_after(5):
            stream = await evil.host.get_network().new_stream(evil.info.peer_id)
            stream_opened = True
            await stream.write(multistream_line("/multistream/1.0.0") + garbage(500))
            await stream.read(100)
    except Exception:
        pass
    assert stream_opened


async def _after_noise(evil: HostilePeer) -> None:
    await evil.send_after_noise(garbage(2000), negotiate_yamux=False)


async def _yamux_garbage(evil: HostilePeer) -> None:
    await evil.send_after_noise(garbage(2000), negotiate_yamux=True)


# (case, attack, the reason it must be counted under; truncation and a failed connection upgrade are
#  counted but charged to no one, since a lost connection looks the same and libp2p names no peer there;
#  garbage in a stream's protocol negotiation is refused by multistream-select with only survival asserted)
CASES = [
    ("rpc_random", _rpc_random, "gossip_rpc_malformed"),
    ("rpc_truncated", _rpc_truncated, "gossip_rpc_truncated"),
    ("rpc_huge_length", _rpc_huge_length, "gossip_rpc_oversize"),
    ("rpc_bad_varint", _rpc_bad_varint, "gossip_rpc_malformed"),
    ("rpc_forged_message", _rpc_forged_message, "gossip_bad_signature"),
    ("rpc_unsigned_message", _rpc_unsigned_message, "gossip_bad_signature"),
    ("rpc_control_flood", _rpc_control_flood, "gossip_rpc_too_many_entries"),
    ("identify_push_garbage", _identify_push_garbage, "identify_malformed"),
    ("negotiation_garbage", _negotiation_garbage, None),
    ("garbage_after_noise", _after_noise, "connection_upgrade_failed"),
    ("yamux_garbage", _yamux_garbage, "connection_upgrade_failed"),
]


@pytest.mark.parametrize("name,attack,reason", CASES, ids=[c[0] for c in CASES])
async def test_hostile_input_in_libp2p_handlers_is_contained(tmp_path, name, attack, reason):
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", **CALM))
        honest, _ = await start_node(nursery, fast_config(tmp_path / "honest", bootstrap=node.host.listen_addrs(),
                                                          **CALM))
        node_id, honest_id = node.keypair.peer_id, honest.keypair.peer_id
        await wait_until(lambda: node.membership.table.alive() == [honest_id], timeout_s=20)

        evil = HostilePeer(node.host.listen_addrs()[0])
        async with evil.host.run([]):
            await evil.connect()
            for _ in range(3):
                await attack(evil)
            if reason is not None:
                await wait_until(lambda: node.host.statistics().offences.get(reason, 0) >= 1, timeout_s=10)
            await evil.host.close()

        # Honest gossip still flows both ways for a whole dead-after period.
        seen_by_node = node.membership.table.peers[honest_id].last_seen
        seen_by_honest = honest.membership.table.peers[node_id].last_seen
        await trio.sleep(node.config.dead_after_s)
        assert node.membership.table.alive() == [honest_id]
        assert honest.membership.table.alive() == [node_id]
        assert node.membership.table.peers[honest_id].last_seen > seen_by_node
        assert honest.membership.table.peers[node_id].last_seen > seen_by_honest
        if reason is not None and reason not in ("gossip_rpc_truncated", "connection_upgrade_failed"):
            assert node.traffic.drops[reason] >= 1  # charged to the peer through the offence handler
            assert node.membership.scores.score(evil.peer_id, trio.current_time()) < 0
        nursery.cancel_scope.cancel()


async def test_copies_of_a_message_already_seen_are_dropped_without_a_signature_check(tmp_path, monkeypatch):
    """Each mesh peer relays each message: only the first copy costs an Ed25519 verify (and a task)."""
    from p2p import guards
    from protocol.envelope import seal
    from protocol.keys import Keypair
    from protocol.messages import Announce, HardwareSummary

    checked = []
    real_validator = guards.signature_validator
    monkeypatch.setattr(guards, "signature_validator", lambda msg: checked.append(msg.seqno) or real_validator(msg))
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", **CALM))
        identity = Keypair.from_label("relayed-announcer")
        evil = HostilePeer(node.host.listen_addrs()[0], seed=identity.seed)
        assert evil.peer_id == identity.peer_id
        announce = Announce(peer_id=identity.peer_id, seq=1, addrs=("/ip4/127.0.0.1/tcp/1",), version="0.1.0",
                            roles=("trainer",), hardware=HardwareSummary(devices=("cpu",), memory_bytes=1 << 30,
                                                                          tflops=0.1), control="")
        async with evil.host.run([]):
            await evil.connect()
            session = RawPeerSession(evil)
            frame = session.gossip_frame(ANNOUNCE_TOPIC, seal(announce, identity))
            stream = await session.open(MESHSUB)
            await stream.write(rpc_bytes(subscribe=[ANNOUNCE_TOPIC]) + frame)
            await wait_until(lambda: identity.peer_id in node.membership.table.peers, timeout_s=10)
            first = len(checked)
            for _ in range(5):
                await stream.write(frame)  # the same message again, as five more mesh peers would relay it
            probe = session.gossip_frame(ANNOUNCE_TOPIC, b"junk")  # a new one, read after them
            await stream.write(probe)
            await wait_until(lambda: node.host.statistics().gossip_rejected >= 1
                             or len(checked) > first, timeout_s=10)
            assert len(checked) == first + 1  # the probe alone
            await evil.host.close()
        nursery.cancel_scope.cancel()


async def test_a_banned_peer_is_refused_when_it_reconnects_and_leaves_the_mesh(tmp_path):
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", **CALM))
        evil = HostilePeer(node.host.listen_addrs()[0])
        async with evil.host.run([]):
            await evil.connect()
            for _ in range(8):  # 20 points each: banned at 100
                await _rpc_random(evil)
                if node.membership.is_banned(evil.peer_id):
                    break
            await wait_until(lambda: node.membership.is_banned(evil.peer_id), timeout_s=10)
            await wait_until(lambda: evil.peer_id not in node.host.connected_peers(), timeout_s=10)

            refused_before = node.host.statistics().offences.get("banned_connection_refused", 0)
            for _ in range(3):
                try:
                    await evil.connect()
                except Exception:
                    pass  # refused, as it should be
                await trio.sleep(0.2)
            assert evil.peer_id not in node.host.connected_peers()
            assert node.host.statistics().offences.get("banned_connection_refused", 0) > refused_before
            pubsub = node.host._pubsub
            assert all(evil.peer_id not in {str(p) for p in peers} for peers in pubsub.router.mesh.values())
            assert evil.peer_id not in {str(p) for p in pubsub.peers}
            assert node.host.statistics().blocked_peers == 1
            await evil.host.close()
        nursery.cancel_scope.cancel()


async def test_refused_reconnects_of_banned_peers_never_lock_out_new_peers(tmp_path):
    """Each refusal once leaked one of libp2p's resource-manager connection slots (1,000 in all): banned
    peers redialling locked every new peer out for good."""
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", **CALM))
        manager = node.host._host.get_network()._resource_manager
        for _ in range(30):
            evil = HostilePeer(node.host.listen_addrs()[0])
            async with evil.host.run([]):
                await evil.connect()
                await node.host.block_peer(evil.peer_id, 300)
                try:
                    await evil.connect()
                except Exception:
                    pass  # refused
                await evil.host.close()
        assert node.host.statistics().offences["banned_connection_refused"] >= 10
        assert manager._current_connections <= 2, f"{manager._current_connections} slots held after the refusals"
        newcomer = HostilePeer(node.host.listen_addrs()[0])
        async with newcomer.host.run([]):
            await newcomer.connect()
            await wait_until(lambda: newcomer.peer_id in node.host.connected_peers(), timeout_s=10)
            await newcomer.host.close()
        nursery.cancel_scope.cancel()


async def test_inbound_connection_slots_come_back_when_connections_end(tmp_path):
    """py-libp2p held each inbound connection's admission slot until the host stopped: after max_connections
    connections in a node's life (any peers, honest ones too) it refused everybody new."""
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", max_peers=4, **CALM))  # 8 slots
        for _ in range(12):
            visitor = HostilePeer(node.host.listen_addrs()[0])
            async with visitor.host.run([]):
                await visitor.connect()
                await wait_until(lambda: visitor.peer_id in node.host.connected_peers(), timeout_s=10)
                await visitor.host.close()
            await wait_until(lambda: visitor.peer_id not in node.host.connected_peers(), timeout_s=10)
        nursery.cancel_scope.cancel()


async def test_one_peer_cannot_hold_more_than_its_share_of_streams(tmp_path):
    """Silent ping streams, opened all at once: the library's ping handler waits 10 s for each, unpunished."""
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", **CALM))
        evil = HostilePeer(node.host.listen_addrs()[0])
        async with evil.host.run([]):
            await evil.connect()
            session = RawPeerSession(evil)

            async def open_one() -> None:
                try:
                    with trio.move_on_after(10):
                        await session.open(PING)
                        await trio.sleep_forever()
                except Exception:
                    pass  # reset once over the cap

            async with trio.open_nursery() as openers:
                for _ in range(MAX_INBOUND_STREAMS_PER_PEER + 20):
                    openers.start_soon(open_one)
                await wait_until(lambda: node.host.statistics().offences.get("too_many_streams", 0) >= 1,
                                 timeout_s=10)
                openers.cancel_scope.cancel()
            await evil.host.close()
        nursery.cancel_scope.cancel()


async def test_thousands_of_peers_in_the_peerstore_never_evict_our_own_identity(tmp_path):
    """py-libp2p evicts peers without addresses first, and our own entry has none: publishing then failed."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from multiaddr import Multiaddr

    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", **CALM))
        peerstore = node.host._host.get_peerstore()
        for _ in range(peerstore.max_peers + 200):
            key_pair = create_new_key_pair()
            peer_id = ID.from_pubkey(key_pair.public_key)
            peerstore.add_pubkey(peer_id, key_pair.public_key)
            peerstore.add_addr(peer_id, Multiaddr("/ip4/127.0.0.1/tcp/9"), 3600)  # stored, never dialled
        assert len(peerstore.peer_data_map) <= peerstore.max_peers
        await node.host.publish(ANNOUNCE_TOPIC, node.membership.announcement())
        nursery.cancel_scope.cancel()
