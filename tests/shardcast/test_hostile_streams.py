"""Hostile input on /shoal/manifest/1, /shoal/shard/1, /shoal/have/1 and the shards topic, over real libp2p hosts.

One node serves; an attacker abuses every input path; an honest peer fetches a fresh file from the
node after each case. Each case must be counted by reason, charged to the attacker only, and leave
the node serving the honest peer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections import Counter
from contextlib import AsyncExitStack

import pytest
import trio

from p2p.api import HostConfig
from p2p.framing import recv_message, send_message
from p2p.host import open_host
from protocol.envelope import seal
from protocol.errors import IntegrityError, LocalStoreError, PeerUnreachable, StreamClosed, TransportError
from protocol.keys import Keypair
from protocol.manifest import (KIND_FILE, Have, Haves, ManifestRequest, ShardHeader, ShardRequest, bitfield_from_indices,
                               STATUS_SEEDED, make_manifest, manifest_id, seal_manifest)
from protocol.scores import Scoreboard

from node.shardcast import MANIFEST_PROTOCOL, SHARD_PROTOCOL, TOPIC, ShardcastConfig, ShardcastService, ShardStore
from node.shardcast import transfer
from node.shardcast.haves import HAVE_PROTOCOL
from node.shardcast.serving import MAX_HAVE_STREAMS_PER_PEER
from tests.shardcast.conftest import wait_until

pytestmark = pytest.mark.slow

MiB = 1 << 20
CFG = dict(shard_bytes=MiB, inactivity_s=1.0, have_interval_s=0.02, busy_retry_s=0.2, query_interval_s=0.3,
           stall_timeout_s=20.0, max_streams_per_peer=4, unknown_requests_per_s=2.0, unknown_request_burst=10,
           gossip_per_s=5.0, gossip_burst=30, max_known_manifests=8, max_unknown_have_manifests=4,
           keep_manifests=64)


MISUSES = (  # (reason, what the attacker writes, whether it then half-closes)
    ("garbage", struct.pack(">I", 64) + os.urandom(64), True),
    ("oversize", b"\xff\xff\xff\xff", False),
    ("truncated", struct.pack(">I", 100) + b"\x93\x01", True),
    ("silent", b"", False))


class Charges:
    """The node's penalize hook: a real Scoreboard plus (peer, reason) counts."""

    def __init__(self):
        self.board = Scoreboard(ban_at=1e9)
        self.by_peer: Counter[tuple[str, str]] = Counter()

    def __call__(self, peer: str, reason: str) -> None:
        self.by_peer[(peer, reason)] += 1
        self.board.penalize(peer, reason, trio.current_time())

    def of(self, peer: str) -> dict[str, int]:
        return {r: n for (p, r), n in self.by_peer.items() if p == peer}


async def _drain(stream) -> None:
    """Read until the node ends the stream (reset or EOF); bounded by the caller."""
    try:
        while await stream.read(65536):
            pass
    except TransportError:
        pass


async def test_abuse_is_counted_charged_and_survived(tmp_path):
    charges = Charges()
    async with AsyncExitStack() as stack:
        keys = {name: Keypair.from_label(f"hostile-{name}") for name in ("node", "honest", "attacker")}
        hosts = {name: await stack.enter_async_context(open_host(kp, HostConfig())) for name, kp in keys.items()}
        nursery = await stack.enter_async_context(trio.open_nursery())
        node = ShardcastService(hosts["node"], keys["node"], ShardStore.open(tmp_path / "node"),
                                penalize=charges, config=ShardcastConfig(**CFG))
        honest_charges = Charges()
        honest = ShardcastService(hosts["honest"], keys["honest"], ShardStore.open(tmp_path / "honest"),
                                  penalize=honest_charges, config=ShardcastConfig(**CFG))
        await nursery.start(node.run)
        await nursery.start(honest.run)
        attacker = hosts["attacker"]
        attacker.subscribe(TOPIC)
        node_id, honest_id, attacker_id = (keys[n].peer_id for n in ("node", "honest", "attacker"))
        rounds = [0]

        async def honest_sees_node_alive() -> None:
            rounds[0] += 1
            src = tmp_path / f"alive{rounds[0]}.bin"
            src.write_bytes(os.urandom(200_000))
            m = await node.publish_file(src)
            got = await honest.fetch(manifest_id(m))
            out = tmp_path / f"alive{rounds[0]}.out"
            honest.export_file(got, out)
            assert out.read_bytes() == src.read_bytes()

        def rejected(reason: str) -> int:
            return node.statistics().requests_rejected.get(reason, 0)

        async def expect(reason: str, before: int) -> None:
            await wait_until(lambda: rejected(reason) > before)
            await honest_sees_node_alive()

        async def misuse_one_stream(proto: str, reason: str, payload: bytes, half_close: bool) -> None:
            before = rejected(reason)
            stream = await attacker.open_stream(node_id, proto)
            if payload:
                await stream.write(payload)
            if half_close:
                await stream.close_write()
            await _drain(stream)
            await expect(reason, before)

        with trio.fail_after(120):
            await hosts["honest"].connect(hosts["node"].listen_addrs()[0])
            await attacker.connect(hosts["node"].listen_addrs()[0])
            await honest_sees_node_alive()
            big = tmp_path / "big.bin"
            big.write_bytes(os.urandom(4 * MiB))
            big_m = await node.publish_file(big)

            # (a) every way to misuse one stream, on both protocols
            for proto in (MANIFEST_PROTOCOL, SHARD_PROTOCOL):
                for misuse in MISUSES:
                    await misuse_one_stream(proto, *misuse)

            # a receiver that asks for a real shard and never reads it
            before = rejected("stalled")
            stream = await attacker.open_stream(node_id, SHARD_PROTOCOL)
            await send_message(stream, ShardRequest(manifest_id=manifest_id(big_m), index=0, fallback=True))
            await wait_until(lambda: rejected("stalled") > before)
            await stream.reset()
            await honest_sees_node_alive()

            # a kept /shoal/shard/2 stream: one honest exchange, then junk where the next request goes
            before = rejected("garbage")
            stream = await attacker.open_stream(node_id, SHARD_PROTOCOL)
            assert transfer.keeps_open(stream)
            shard = big_m.shard_hashes[0]
            assert await transfer.fetch_shard(stream, ShardStore.open(tmp_path / "attacker"),
                                              manifest_id=manifest_id(big_m), index=0, sha256=shard,
                                              nbytes=MiB, deadlines=node.config.deadlines(), fallback=True) == "ok"
            await stream.write(struct.pack(">I", 64) + os.urandom(64))
            await _drain(stream)
            await expect("garbage", before)

            # (b) too many streams at once from one peer
            before = rejected("too_many_streams")
            silent = []
            for _ in range(12):
                try:
                    silent.append(await attacker.open_stream(node_id, SHARD_PROTOCOL))
                except PeerUnreachable:
                    pass  # the node reset it at once: yamux then drops the protocol echo, and the open fails
            await wait_until(lambda: rejected("too_many_streams") > before)
            for s in silent:
                await s.reset()
            await honest_sees_node_alive()

            # (a) requests for unknown shards and manifests, in a loop
            before = rejected("unknown_flood")
            for i in range(40):
                proto = SHARD_PROTOCOL if i % 2 else MANIFEST_PROTOCOL
                stream = await attacker.open_stream(node_id, proto)
                junk_id = hashlib.sha256(b"nothing %d" % i).digest()
                if proto == SHARD_PROTOCOL:
                    await send_message(stream, ShardRequest(manifest_id=junk_id, index=0, fallback=False))
                else:
                    await send_message(stream, ManifestRequest(manifest_id=junk_id))
                await stream.close_write()
                await _drain(stream)
            assert rejected("unknown_flood") > before
            await honest_sees_node_alive()

            # (b) gossip: Haves for invented manifests, then a manifest flood, past the per-origin rate
            await attacker.wait_for_topic_peer(TOPIC, node_id)
            for i in range(10):
                have = Have(manifest_id=hashlib.sha256(b"invented %d" % i).digest(), num_shards=4,
                            bitfield=bitfield_from_indices(4, {0, 1, 2, 3}))
                await attacker.publish(TOPIC, seal(have, keys["attacker"]))
            batch = Haves(haves=tuple(Have(manifest_id=hashlib.sha256(b"batched %d" % i).digest(), num_shards=4,
                                           bitfield=bitfield_from_indices(4, {0})) for i in range(16)))
            await attacker.publish(TOPIC, seal(batch, keys["attacker"]))
            for i in range(40):
                m = make_manifest(kind=KIND_FILE, label=f"flood{i}", version=i, total_bytes=2048, shard_bytes=1024,
                                  shard_hashes=[hashlib.sha256(b"%d-%d" % (i, j)).digest() for j in range(2)])
                await attacker.publish(TOPIC, seal_manifest(m, keys["attacker"]).sealed)
            limits = lambda: node.statistics().limits_hit  # noqa: E731
            await wait_until(lambda: limits().get("gossip_flood", 0) > 0 and limits().get("known_manifests", 0) > 0
                             and limits().get("unknown_have_manifests", 0) > 0)
            assert len(node._known) <= CFG["max_known_manifests"]
            # A batch of Haves buys no more room for invented manifests than single Haves do.
            unknown = [m for m in node._holders if not node._is_known(m)]
            assert len(unknown) <= node.config.max_unknown_have_manifests
            await honest_sees_node_alive()

            # (a) and (b) on Have streams: junk, then more streams than one peer needs, then Haves past the rate
            for misuse in MISUSES:
                if misuse[0] != "silent":  # an idle Have stream is the sender's right
                    await misuse_one_stream(HAVE_PROTOCOL, *misuse)
            before = rejected("too_many_streams")
            kept = []
            for _ in range(MAX_HAVE_STREAMS_PER_PEER + 2):
                try:
                    kept.append(await attacker.open_stream(node_id, HAVE_PROTOCOL))
                except PeerUnreachable:
                    pass
            await wait_until(lambda: rejected("too_many_streams") > before)
            for s in kept[1:]:
                await s.reset()
            flood_before = limits().get("have_flood", 0)
            invented = Haves(haves=tuple(Have(manifest_id=hashlib.sha256(b"streamed %d" % i).digest(), num_shards=4,
                                              bitfield=bitfield_from_indices(4, {1})) for i in range(16)))
            with trio.move_on_after(5), contextlib.suppress(StreamClosed):
                for _ in range(CFG["gossip_burst"] + 20):
                    await send_message(kept[0], invented)  # until the node resets the stream
            await wait_until(lambda: limits().get("have_flood", 0) > flood_before)
            await kept[0].reset()
            unknown = [m for m in node._holders if not node._is_known(m)]
            assert len(unknown) <= node.config.max_unknown_have_manifests
            await honest_sees_node_alive()
            assert node.statistics().haves_received > 0 and honest.statistics().haves_sent > 0

            # (c) a shard rotted on the honest receiver's own disk: a local error, the producer is not charged
            got_m = await honest.fetch(manifest_id(big_m))
            victim = honest.store.shard_path(got_m.shard_hashes[2])
            victim.write_bytes(os.urandom(victim.stat().st_size))
            with pytest.raises(LocalStoreError):
                honest.export_file(got_m, tmp_path / "rotted.out")
            assert honest.statistics().local_corruptions == 1 and not honest_charges.of(node_id)
            await honest.fetch(manifest_id(got_m))  # the dropped shard is fetched again
            honest.export_file(got_m, tmp_path / "repaired.out")
            assert (tmp_path / "repaired.out").read_bytes() == big.read_bytes()

            # (c) a shard rotted on the node's disk: the requester's nack makes the node drop it, charging nobody
            sha = big_m.shard_hashes[1]
            path = node.store.shard_path(sha)
            path.write_bytes(os.urandom(path.stat().st_size))
            # The node published big_m and seeds it: a shard it sent out less than its unheard wait ago (3 s) is
            # answered "seeded" (get it from whoever took it), as any requester is told; ask again as a fetcher would.
            scratch = ShardStore.open(tmp_path / "scratch")
            with pytest.raises(IntegrityError), trio.fail_after(4 * node.config.reseed_after_s):
                while True:
                    stream = await hosts["honest"].open_stream(node_id, SHARD_PROTOCOL)
                    status = await transfer.fetch_shard(stream, scratch, manifest_id=manifest_id(big_m), index=1,
                                                        sha256=sha, nbytes=MiB, deadlines=node.config.deadlines(),
                                                        fallback=True)
                    assert status == STATUS_SEEDED, status
                    await trio.sleep(node.config.busy_retry_s)
            await wait_until(lambda: node.statistics().local_corruptions == 1)
            assert not node.store.has_shard(sha)
            await honest_sees_node_alive()

        assert honest_id in hosts["node"].connected_peers()
        assert charges.of(honest_id) == {}, "the honest peer was charged"
        charged = charges.of(attacker_id)
        for reason in ("garbage", "oversize", "truncated", "silent", "stalled", "too_many_streams", "unknown_flood",
                       "gossip_flood", "have_flood"):
            assert charged.get(f"shard_{reason}", 0) > 0, (reason, charged)
        assert charges.board.score(attacker_id, trio.current_time()) < 0
        print(f"\nhostile: charged {dict(charged)}; limits {node.statistics().limits_hit}")
        nursery.cancel_scope.cancel()
