"""Guards around py-libp2p 0.8.1's own input paths: its stream handlers, its pubsub read loop, its connections.

Our handlers and validators are contained in p2p.host; this module covers what the library runs
itself. Each guard names the library behaviour it answers. Every offence is reported through
``Offences.report(peer_id, reason)`` so the node can count it and charge the peer.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Any, Callable

import trio
from google.protobuf.message import DecodeError as ProtobufDecodeError
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IncompleteReadError, IOException
from libp2p.network.connection.exceptions import RawConnError
from libp2p.network.exceptions import SwarmException
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import signature_validator
from libp2p.io.exceptions import MessageTooLarge
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

logger = logging.getLogger(__name__)

CLEANUP_S = 5.0

MAX_PUBLISH_PER_RPC = 256
"""Messages in one RPC. The library schedules one task per message without a cap."""
MAX_CONTROL_ENTRIES = 1024
"""GRAFT/PRUNE/IHAVE/IWANT entries (and message ids inside them) in one RPC."""
MAX_MESSAGE_KEY_BYTES = 128
"""An Ed25519 key fits in the peer id; a large ``key`` field would make us parse and verify an RSA key."""

_GONE = (StreamEOF, StreamError, IOException, RawConnError, IncompleteReadError, trio.BrokenResourceError,
         trio.ClosedResourceError)


class Offences:
    """Counts what peers did wrong inside libp2p, by reason, and hands each offence to the node."""

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self._handler: Callable[[str, str], None] | None = None

    def set_handler(self, handler: Callable[[str, str], None] | None) -> None:
        self._handler = handler

    def count(self, reason: str) -> None:
        """An event worth counting that no peer can be blamed for (a connection lost mid-frame)."""
        self.by_reason[reason] += 1

    def report(self, peer_id: Any, reason: str) -> None:
        self.by_reason[reason] += 1
        logger.debug("offence from %s: %s", peer_id, reason)
        if self._handler is not None:
            try:
                self._handler(str(peer_id), reason)
            except Exception:  # runs inside libp2p's tasks: an exception here would stop the host
                logger.exception("offence handler failed for %s (%s)", peer_id, reason)


async def _reset_quietly(stream: Any) -> None:
    with trio.move_on_after(CLEANUP_S, shield=True):
        try:
            await stream.reset()
        except Exception:
            pass  # the stream or its connection is already gone


MAX_INBOUND_STREAMS_PER_PEER = 128
"""Streams one peer may have open towards us at once, all protocols together. An honest node uses a
handful (gossip, a few shard transfers); py-libp2p's only limit is 10,000 for everyone together."""


def guard_swarm_streams(raw_host: Any, offences: Offences) -> None:
    """Contain every inbound stream: protocol negotiation and the library's own handlers.

    py-libp2p runs each inbound stream's negotiation and handler (identify, identify-push,
    ping, pubsub) in the connection's nursery; an exception escaping any of them tears down
    the swarm and the whole host (e.g. protobuf's DecodeError from pubsub, notes §2026-12-01).
    One peer's concurrent streams are capped too, so it cannot use up the shared limit.
    """
    inner = raw_host._swarm_stream_handler
    open_by_peer: Counter[str] = Counter()

    async def guarded(net_stream: Any) -> None:
        peer = str(getattr(getattr(net_stream, "muxed_conn", None), "peer_id", "?"))
        if open_by_peer[peer] >= MAX_INBOUND_STREAMS_PER_PEER:
            offences.report(peer, "too_many_streams")
            await _reset_quietly(net_stream)
            return
        open_by_peer[peer] += 1
        try:
            await inner(net_stream)
        except _GONE:
            pass  # the peer went away mid-stream: routine
        except Exception:
            peer_id = getattr(getattr(net_stream, "muxed_conn", None), "peer_id", "?")
            protocol = _protocol_of(net_stream)
            logger.debug("inbound %s stream from %s failed", protocol, peer_id, exc_info=True)
            offences.report(peer_id, "stream_error")
            await _reset_quietly(net_stream)
        finally:
            open_by_peer[peer] -= 1
            if open_by_peer[peer] <= 0:
                del open_by_peer[peer]

    raw_host.get_network().set_stream_handler(guarded)


def _protocol_of(net_stream: Any) -> str:
    try:
        return str(net_stream.get_protocol())
    except Exception:
        return "?"


def guard_pubsub(raw_host: Any, pubsub: Any, offences: Offences, *, max_message_bytes: int) -> None:
    """Replace pubsub's stream handler with one read loop that judges every RPC before the library sees it.

    The library's loop (Pubsub.continuously_read_stream) lets protobuf's DecodeError escape and
    stop the host; drops an RPC over max_inbound_rpc_size, a message with a bad or missing
    signature, or an invalid signed peer record with only a log line; and starts one task per
    published message with no cap. Here each of those is an offence charged to the sender, and
    only well-formed parts are handed to the library's own methods.
    """

    async def read_rpcs(stream: Any) -> None:
        peer_id = stream.muxed_conn.peer_id
        frames = _FrameReader(stream)
        try:
            while pubsub.manager.is_running:
                try:
                    frame = await frames.next(pubsub.max_inbound_rpc_size)
                except MessageTooLarge:
                    offences.report(peer_id, "gossip_rpc_oversize")
                    await _reset_quietly(stream)
                    return
                except IncompleteReadError:  # also what a connection lost mid-frame looks like
                    offences.count("gossip_rpc_truncated")
                    return
                except ParseError:  # a varint length longer than 64 bits
                    offences.report(peer_id, "gossip_rpc_malformed")
                    await _reset_quietly(stream)
                    return
                if frame is None:
                    return  # a clean end between frames
                rpc = rpc_pb2.RPC()
                try:
                    rpc.ParseFromString(frame)
                except (ProtobufDecodeError, ValueError, RuntimeWarning):
                    offences.report(peer_id, "gossip_rpc_malformed")
                    await _reset_quietly(stream)
                    return
                if not await _handle_rpc(rpc, peer_id):
                    await _reset_quietly(stream)
                    return
        except _GONE:
            return  # EOF, a reset or a closed connection: the peer left

    async def _handle_rpc(rpc: Any, peer_id: ID) -> bool:
        """False when the RPC is bad enough to drop the stream."""
        # py-libp2p attaches its signed peer record to every RPC and verifies each one it receives: an
        # Ed25519 check per RPC for addresses Shoal never dials (peers' addresses come from their
        # signed announcements). The record is dropped unread, as peers of other libp2p stacks do.
        rpc.ClearField("senderRecord")
        if len(rpc.publish) > MAX_PUBLISH_PER_RPC or _control_entries(rpc) > MAX_CONTROL_ENTRIES:
            offences.report(peer_id, "gossip_rpc_too_many_entries")
            return False
        for msg in rpc.publish:
            # A message already seen is one more mesh peer's copy: the library drops it unread, so it gets
            # neither a signature check (an Ed25519 verify per copy, D copies per message) nor a task here.
            if not pubsub._is_subscribed_to_msg(msg) or pubsub._is_msg_seen(msg):
                continue
            if len(msg.data) > max_message_bytes:
                offences.report(peer_id, "gossip_oversize")
                continue
            if len(msg.key) > MAX_MESSAGE_KEY_BYTES or not _signature_ok(msg):
                offences.report(peer_id, "gossip_bad_signature")
                continue
            if pubsub.manager.is_running:
                pubsub.manager.run_task(_push_guarded, peer_id, msg)
        if rpc.subscriptions:
            if len(rpc.subscriptions) > pubsub.max_subscriptions_per_rpc:
                offences.report(peer_id, "gossip_too_many_subscriptions")
            else:
                for sub in rpc.subscriptions:
                    pubsub.handle_subscription(peer_id, sub)
        if rpc.HasField("control"):
            try:
                await pubsub.router.handle_rpc(rpc, peer_id)
            except _GONE:
                raise
            except Exception:
                logger.debug("gossipsub control from %s failed", peer_id, exc_info=True)
                offences.report(peer_id, "gossip_control_malformed")
                return False
        return True

    async def _push_guarded(peer_id: ID, msg: Any) -> None:
        # push_msg runs in pubsub's service manager: an exception would stop pubsub.
        try:
            await pubsub.push_msg(peer_id, msg)
        except Exception:
            logger.debug("pubsub push from %s failed", peer_id, exc_info=True)
            offences.report(peer_id, "gossip_malformed")

    for protocol in pubsub.router.get_protocols():
        raw_host.set_stream_handler(protocol, read_rpcs)


READ_CHUNK_BYTES = 64 * 1024
"""What one read of a pubsub stream asks for. Yamux answers a read with a window update, so reading
a frame's varint a byte at a time sent two or three updates (30 wire bytes and a Noise encryption
each) for every gossip RPC received."""


class _FrameReader:
    """Varint-prefixed frames from a stream, read in chunks: one read usually brings several frames."""

    def __init__(self, stream: Any):
        self._stream, self._buf = stream, bytearray()

    async def _fill(self) -> bool:
        try:
            chunk = await self._stream.read(READ_CHUNK_BYTES)
        except StreamEOF:
            chunk = b""
        self._buf += chunk
        return bool(chunk)

    async def next(self, max_bytes: int) -> bytes | None:
        """One frame; None at a clean end between frames, IncompleteReadError inside one.
        The length is checked against ``max_bytes`` before the body is waited for."""
        while True:
            length, shift, size = 0, 0, 0
            for position, byte in enumerate(self._buf[:10]):
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    size = position + 1
                    break
            else:
                if len(self._buf) >= 10:
                    raise ParseError("varint length longer than 64 bits")
            if size:
                break
            if not await self._fill():
                if not self._buf:
                    return None
                raise IncompleteReadError("stream ended inside a length prefix")
        if length > max_bytes:
            raise MessageTooLarge(f"frame of {length} bytes exceeds {max_bytes}")
        while len(self._buf) < size + length:
            if not await self._fill():
                raise IncompleteReadError(f"stream ended after {len(self._buf) - size} of {length} bytes")
        frame = bytes(self._buf[size:size + length])
        del self._buf[:size + length]
        return frame


def _signature_ok(msg: Any) -> bool:
    try:
        return bool(signature_validator(msg))
    except Exception:  # garbage from_id or key bytes raise from the key parsers
        return False


def _control_entries(rpc: Any) -> int:
    if not rpc.HasField("control"):
        return 0
    c = rpc.control
    ids = sum(len(x.messageIDs) for x in c.ihave) + sum(len(x.messageIDs) for x in c.iwant)
    return len(c.ihave) + len(c.iwant) + len(c.graft) + len(c.prune) + ids


async def _teardown_if_connected(pubsub: Any, peer_id: Any) -> None:
    """py-libp2p 0.8.1's blacklist teardown, made safe: it resets the peer's pubsub stream and then deleted
    the peer from ``pubsub.peers`` without looking. The disconnect that follows a ban (or the connection's
    own close) removes it while the reset is under way, and the KeyError ended the Pubsub service, so
    banning a peer we gossip with stopped the node."""
    stream = pubsub.peers.get(peer_id)
    if stream is not None:
        try:
            await stream.reset()
        except Exception:
            pass  # the stream is being dropped either way
        if pubsub.peers.get(peer_id) is stream:
            del pubsub.peers[peer_id]
    pubsub._forget_all_subscriptions(peer_id)


class PeerGate:
    """Refuses connections from blocked peers, in both directions, before anything runs on them.

    Disconnecting a banned peer is not enough in py-libp2p: it may dial again at once and rejoin
    the gossip mesh. The swarm's add_conn is where every upgraded connection (inbound or
    outbound) is registered, before any notifee (pubsub, identify) hears of it.
    """

    def __init__(self, raw_host: Any, pubsub: Any, offences: Offences):
        self._pubsub = pubsub
        self._blocked_until: dict[str, float] = {}
        self.refused = 0
        swarm = raw_host.get_network()
        inner = swarm.add_conn

        async def add_conn(muxed_conn: Any, direction: str = "unknown") -> Any:
            peer_id = str(muxed_conn.peer_id)
            if self.is_blocked(peer_id):
                self.refused += 1
                offences.by_reason["banned_connection_refused"] += 1
                with trio.move_on_after(CLEANUP_S, shield=True):
                    try:
                        await muxed_conn.close()
                    except Exception:
                        pass
                # The swarm attached the connection's resource-manager scope to muxed_conn and
                # releases it only through a SwarmConn; refused here, it would leak one of the
                # resource manager's connection slots per refusal until no peer could connect.
                scope = getattr(muxed_conn, "_resource_scope", None)
                if scope is not None:
                    scope.close()
                raise SwarmException(f"peer {peer_id} is banned")
            return await inner(muxed_conn, direction)

        swarm.add_conn = add_conn
        pubsub._teardown_if_connected = functools.partial(_teardown_if_connected, pubsub)

    def block(self, peer_id: str, duration_s: float) -> None:
        self._blocked_until[peer_id] = trio.current_time() + duration_s
        # Blacklisting also drops the peer from every topic and ignores what it forwarded.
        self._pubsub.add_to_blacklist(ID.from_base58(peer_id))

    def is_blocked(self, peer_id: str) -> bool:
        until = self._blocked_until.get(peer_id)
        if until is None:
            return False
        if trio.current_time() < until:
            return True
        del self._blocked_until[peer_id]
        try:
            self._pubsub.remove_from_blacklist(ID.from_base58(peer_id))
        except Exception:
            pass  # never blacklisted there (or already removed)
        return False

    def blocked(self) -> list[str]:
        return [p for p in list(self._blocked_until) if self.is_blocked(p)]


MAX_IDENTIFY_BYTES = 64 * 1024
"""An identify message with a few addresses and protocols is well under 4 KiB; the library allows 1 MiB."""


def guard_identify_push(raw_host: Any, offences: Offences) -> None:
    """Identify-push, judged here: the library's handler logs garbage at ERROR and charges no one."""
    from libp2p.identity.identify.pb.identify_pb2 import Identify
    from libp2p.identity.identify_push.identify_push import ID_PUSH
    from libp2p.identity.update import update_peerstore_from_identify

    async def handle(stream: Any) -> None:
        peer_id = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(10.0):
                frame = await read_varint_prefixed_bytes_limited(stream, MAX_IDENTIFY_BYTES)
            message = Identify()
            message.ParseFromString(frame)
        except (MessageTooLarge, ParseError, ProtobufDecodeError, ValueError, RuntimeWarning, trio.TooSlowError):
            offences.report(peer_id, "identify_malformed")
            await _reset_quietly(stream)
            return
        except _GONE:
            return
        await update_peerstore_from_identify(raw_host.get_peerstore(), peer_id, message)
        with trio.move_on_after(CLEANUP_S, shield=True):
            try:
                await stream.close()
            except Exception:
                pass

    raw_host.set_stream_handler(ID_PUSH, handle)


def fix_prune_backoff(gossipsub: Any) -> None:
    """Record a backoff for every peer we PRUNE, as go-libp2p's gossipsub does.

    py-libp2p's mesh heartbeat prunes a crowded mesh without recording a backoff on its own
    side, so a later heartbeat may GRAFT the same peer again seconds later; that peer, which
    took our PRUNE as "back off for 60 s", then logs "GRAFT flood detected ... applying
    penalty" against an honest node (6-41 times per node in a 16-node swarm). With the
    backoff on both sides neither end re-grafts early.
    """
    heartbeat, emit_prune = gossipsub.mesh_heartbeat, gossipsub.emit_prune

    def mesh_heartbeat() -> Any:
        peers_to_graft, peers_to_prune = heartbeat()
        for peer, topics in peers_to_prune.items():
            for topic in topics:
                gossipsub._add_back_off(peer, topic, False)
        return peers_to_graft, peers_to_prune

    async def emit_prune_with_backoff(topic: str, to_peer: Any, do_px: bool, is_unsubscribe: bool) -> None:
        gossipsub._add_back_off(to_peer, topic, is_unsubscribe)
        await emit_prune(topic, to_peer, do_px, is_unsubscribe)

    gossipsub.mesh_heartbeat = mesh_heartbeat
    gossipsub.emit_prune = emit_prune_with_backoff


def fix_inbound_slots(raw_host: Any, offences: Offences) -> None:
    """Give an inbound connection's slot back when the connection ends, not when the host stops.

    py-libp2p admits inbound connections through a CapacityLimiter (max_connections slots),
    and its handler keeps its slot until the whole swarm shuts down ("intentional barrier":
    ``await self.manager.wait_finished()``). Every inbound connection ever accepted, honest
    reconnects included, uses one up: after ~max_connections of them the node refuses every
    new peer for good (found by scripts/fuzz_wire.py at about 130 identities). Here the
    handler lives exactly as long as its connection.
    """
    from libp2p.abc import IMuxedConn
    from libp2p.network.connection.raw_connection import RawConnection

    swarm = raw_host.get_network()
    inner = swarm._do_handle_inbound_connection

    async def close_quietly(resource: Any) -> None:
        with trio.move_on_after(CLEANUP_S, shield=True):
            try:
                await resource.close()
            except Exception:
                pass

    async def handle(read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
        if isinstance(read_write_closer, IMuxedConn):
            await inner(read_write_closer, maddr, failure_event)  # QUIC and the like: not ours to change
            return
        remote = swarm._build_remote_multiaddr(read_write_closer)
        if remote is not None and not await swarm.connection_gate.is_allowed(remote):
            await close_quietly(read_write_closer)
            return
        raw_conn = RawConnection(read_write_closer, False)
        try:
            muxed_conn = await swarm.upgrade_inbound_raw_conn(raw_conn, maddr)
        except Exception as exc:
            # Before the muxer runs, the swarm does not tell us who it was: counted, charged to no one.
            logger.debug("inbound connection from %s failed: %r", remote, exc)
            offences.count("connection_upgrade_failed")
            await close_quietly(raw_conn)
            return
        registered = [c for c in swarm.connections.get(muxed_conn.peer_id, []) if c.muxed_conn is muxed_conn]
        if registered:
            # The TCP stream belongs to this handler: trio closes it when the handler returns.
            await registered[0].event_closed.wait()

    swarm._do_handle_inbound_connection = handle


def protect_peerstore(raw_host: Any) -> None:
    """Never evict our own identity (or a connected peer) from the peerstore.

    py-libp2p's peerstore keeps at most 1,000 peers and evicts entries without addresses
    first, and our own entry holds keys but no addresses: after about a thousand distinct
    peers (5,000 attacker identities in the wire fuzzer) it evicted us, and the next publish
    failed with "peer ID not found" inside the heartbeat.
    """
    peerstore = raw_host.get_peerstore()

    def enforce_peer_limit() -> None:
        excess = len(peerstore.peer_data_map) - peerstore.max_peers
        if excess <= 0:
            return
        keep = {raw_host.get_id(), *raw_host.get_connected_peers()}
        # Same order as the library: entries without addresses, then expired ones, go first.
        candidates = sorted((item for item in peerstore.peer_data_map.items() if item[0] not in keep),
                            key=lambda item: (not item[1].get_addrs(), item[1].is_expired()), reverse=True)
        for peer_id, _ in candidates[:excess]:
            peerstore.peer_record_map.pop(peer_id, None)
            del peerstore.peer_data_map[peer_id]

    peerstore._enforce_peer_limit = enforce_peer_limit
