"""Bytes on the wire: every byte of every TCP connection a host has, whatever rides on it.

The counters in p2p.streams see only the payload of our own streams. A user's link also carries
multistream negotiation, the Noise handshake and its per-frame tags, Yamux headers and window
updates, gossip (messages, IHAVE/IWANT, GRAFT/PRUNE), identify and ping. Each TCP connection's
socket stream is wrapped before the security upgrade, the first thing the swarm does with a new
connection in either direction, so all of that is counted. A circuit through a relay is not a
socket of its own: its bytes are counted once, on the TCP connection to the relay.

Gossip is also counted by what it carries (count_gossip_bytes): what this host sent of each topic's
messages (its own and those it forwards, every copy), of control (IHAVE, IWANT, GRAFT, PRUNE) and of
subscriptions, so a user can see where the bytes beyond the streams go.

It also takes off what py-libp2p adds to gossip that Shoal does not use: the signed peer record
in every RPC (omit_sender_records) and IDONTWANT for messages too small to be worth one
(idontwant_for_large_messages_only), and has Yamux return receive credit in batches rather than one
window update per read (batch_window_updates).
"""

from __future__ import annotations

import os
from typing import Any

from libp2p.io.abc import ReadWriteCloser
from libp2p.io.trio import TrioTCPStream

from p2p.api import HostStatistics


class CountedStream(ReadWriteCloser):
    """A TCP connection's socket stream whose reads and writes are added to the host's wire counters."""

    def __init__(self, inner: TrioTCPStream, stats: HostStatistics):
        self._inner, self._stats = inner, stats

    async def read(self, n: int | None = None) -> bytes:
        data = await self._inner.read(n)
        self._stats.wire_bytes_received += len(data)
        return data

    async def write(self, data: bytes) -> None:
        await self._inner.write(data)
        self._stats.wire_bytes_sent += len(data)

    async def close(self) -> None:
        await self._inner.close()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self._inner.get_remote_address()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # the socket, the locks: whatever libp2p reaches for


def count_wire_bytes(raw_host: Any, stats: HostStatistics) -> None:
    """Count the TCP bytes of every connection ``raw_host`` dials or accepts into ``stats``."""
    upgrader = raw_host.get_network().upgrader
    upgrade_security = upgrader.upgrade_security

    async def counted_upgrade(raw_conn, is_initiator, peer_id=None):
        stream = getattr(raw_conn, "stream", None)
        if isinstance(stream, TrioTCPStream):
            raw_conn.stream = CountedStream(stream, stats)
        return await upgrade_security(raw_conn, is_initiator, peer_id)

    upgrader.upgrade_security = counted_upgrade


def count_gossip_bytes(pubsub: Any, stats: HostStatistics) -> None:
    """Add each RPC that ``pubsub`` writes to stats.gossip_bytes_sent_by_kind, by topic, "control" and
    "subscriptions" (protobuf sizes, without the length prefix and the stream's framing)."""
    write_msg = pubsub.write_msg

    async def counted_write(stream, rpc_msg) -> bool:
        ok = await write_msg(stream, rpc_msg)
        if ok:
            by_kind = stats.gossip_bytes_sent_by_kind
            for msg in rpc_msg.publish:
                topic = msg.topicIDs[0] if msg.topicIDs else ""
                by_kind[topic] = by_kind.get(topic, 0) + msg.ByteSize()
            if rpc_msg.HasField("control"):
                by_kind["control"] = by_kind.get("control", 0) + rpc_msg.control.ByteSize()
            if len(rpc_msg.subscriptions):
                by_kind["subscriptions"] = by_kind.get("subscriptions", 0) + sum(
                    sub.ByteSize() for sub in rpc_msg.subscriptions)
        return ok

    pubsub.write_msg = counted_write


def omit_sender_records(pubsub: Any) -> None:
    """Send gossip RPCs without py-libp2p's signed peer record.

    py-libp2p puts its signed peer record (an envelope of our addresses, about 250 bytes) in every
    RPC it writes: a 1 KB message cost 1.4 KB on the wire, and a control-only RPC 300 bytes instead
    of about 50. Peers learn our addresses from our signed announcements, and the record is an
    optional field that other libp2p stacks neither send nor read, so it is left out. Building it
    (our addresses, each time) cost more CPU than the rest of a publish, so pubsub's modules get a
    builder that makes none; identify, which uses the record, keeps the library's own."""
    from libp2p.pubsub import gossipsub, pubsub as pubsub_module

    for module in (pubsub_module, gossipsub):
        module.env_to_send_in_RPC = _no_record  # type: ignore[attr-defined]
    write_msg = pubsub.write_msg

    async def write_without_record(stream, rpc_msg) -> bool:
        rpc_msg.ClearField("senderRecord")
        return await write_msg(stream, rpc_msg)

    pubsub.write_msg = write_without_record
    get_hello_packet = pubsub.get_hello_packet

    def hello_without_record():  # the one RPC the library writes without write_msg
        packet = get_hello_packet()
        packet.ClearField("senderRecord")
        return packet

    pubsub.get_hello_packet = hello_without_record


def _no_record(_host: Any) -> tuple[bytes, bool]:
    return b"", False


IDONTWANT_MIN_BYTES = 1024
"""go-libp2p's IDontWantMessageThreshold: below it an IDONTWANT costs about what it saves."""


def idontwant_for_large_messages_only(gossipsub: Any) -> None:
    """Send IDONTWANT (gossipsub v1.2) only for messages of IDONTWANT_MIN_BYTES or more, as go-libp2p does.

    py-libp2p sends it, as an RPC of its own, to every mesh peer for every message it publishes or
    forwards, whatever the size: an 80-byte write and a Noise encryption per peer for each small
    announcement or Have, which is most of what Shoal gossips. A large message still gets one."""
    emit = gossipsub._emit_idontwant_for_message

    async def emit_for_large(msg_id: bytes, topic_ids: Any) -> None:
        msg = gossipsub.mcache.get(msg_id)  # put there just before, by the publish that calls us
        if msg is not None and len(msg.data) >= IDONTWANT_MIN_BYTES:
            await emit(msg_id, topic_ids)

    gossipsub._emit_idontwant_for_message = emit_for_large


YAMUX_RELEASE_ON_READ = "PY_YAMUX_RELEASE_ON_READ"


def batch_window_updates() -> None:
    """Have py-libp2p's Yamux return receive credit in batches, as go-yamux does.

    By default it sends a window update (one encrypted frame) for every read, about one per 64 KiB on a bulk
    stream: a fifth of a receiving event loop. Its own switch turns off one of its per-read branches. Measured on
    loopback, 64 MiB at a time, 12 runs each: a bare stream 310 -> 396 MB/s, the shard protocol 170 -> 222. A read
    that leaves the window short by less than half still returns its credit at once (about one update per gossip
    RPC received). Returning credit only once half a window, or 64 KiB, was owed cut those updates but measured
    slower on rate-limited links, where queues stretch the round trip and the sender waited for credit: 4 netlab
    receivers of 32 MiB took 8.2-11.0 s against 8.0-8.7 s (runs interleaved). An operator's own
    PY_YAMUX_RELEASE_ON_READ is left as it is."""
    os.environ.setdefault(YAMUX_RELEASE_ON_READ, "0")
