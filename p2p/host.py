"""The libp2p Host: TCP + Noise + Yamux + GossipSub behind p2p.api, hardened against py-libp2p 0.8.1's pitfalls.

Past 500 lines on purpose: it is the one adapter from p2p.api to py-libp2p; each method is short, and the
guards and wire fixes it applies already live in their own modules (guards, wire, streams, notifee, nat)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncIterator, Sequence

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair as ed25519_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID as MESHSUB_10, PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub, get_peer_and_seqno_msg_id
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID, Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID, Yamux
from libp2p.tools.anyio_service import background_trio_service

from p2p.streams import _STREAM_ERRORS, _Stream
from p2p.api import (GossipMessage, GossipValidator, HostConfig, HostStatistics, OffenceHandler, Reachability,
                    StreamHandler)
from p2p.guards import (Offences, PeerGate, fix_inbound_slots, fix_prune_backoff, guard_identify_push,
                        guard_pubsub, guard_swarm_streams, protect_peerstore)
from p2p.interfaces import advertise_dialable_over_mdns, is_unspecified
from p2p.notifee import ConnectionEvents
from p2p.nat import NatService
from p2p.frames import write_whole_frames
from p2p.wire import (batch_window_updates, count_gossip_bytes, count_wire_bytes, idontwant_for_large_messages_only,
                      omit_sender_records)
from protocol.errors import PeerUnreachable, StreamClosed, TransportError
from protocol.keys import Keypair

logger = logging.getLogger(__name__)

# Importing libp2p detaches its logger; warnings such as dropped pubsub messages must stay visible.
logging.getLogger("libp2p").propagate = True
logging.getLogger("libp2p").setLevel(logging.WARNING)

CLEANUP_S = 5.0
"""Upper bound for shielded cleanup (stream reset, host close, service shutdown)."""

GOSSIP_RPC_OVERHEAD_BYTES = 64 * 1024
"""Room for the signature, key, topic and protobuf framing around one gossip payload."""

OUTBOUND_QUEUE_LIMIT = 16
"""Publish only while each peer's outbound queue holds fewer RPCs than this (py-libp2p drops past 32),
leaving room for the control messages and relays that share the queue."""
PUBLISH_WAIT_S = 1.0
OUTBOUND_POLL_S = 0.005

MAX_PENDING_FORWARDERS = 4096
"""Validated messages whose forwarder we remember until the subscription consumer picks them up."""

# Errors a libp2p stream raises once its stream or connection is gone (EOF is handled separately).
DISCONNECT_TIMEOUT_S = 2.0
"""How long a disconnect waits for libp2p's orderly close before it closes the socket itself."""

class _DirectDelivery:
    """Stands in for libp2p's per-topic subscription channel, whose only use is send_nowait()."""

    __slots__ = ("_deliver",)

    def __init__(self, deliver):
        self._deliver = deliver

    def send_nowait(self, msg: Any) -> None:
        self._deliver(msg)

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def _to_id(peer_id: str) -> ID:
    try:
        return ID.from_base58(peer_id)
    except Exception as exc:  # base58 and multihash raise assorted ValueErrors
        raise ValueError(f"{peer_id!r} is not a peer id: {exc}") from None


class Libp2pHost:
    """p2p.api.Host over a running libp2p host; create it with open_host()."""

    def __init__(self, keypair: Keypair, config: HostConfig, raw_host: Any, pubsub: Pubsub,
                 nursery: trio.Nursery, offences: Offences, gate: PeerGate, stats: HostStatistics):
        self.peer_id = keypair.peer_id
        self._offences, self._gate = offences, gate
        self._config = config
        self._host = raw_host
        self._pubsub = pubsub
        self._nursery = nursery
        self._stats = stats
        self._joined: dict[str, trio.Event] = {}
        self._forwarders: OrderedDict[bytes, str] = OrderedDict()
        self._publish_lock = trio.Lock()
        self._stuck_peers: set[Any] = set()
        self._discovered_send, self._discovered_receive = trio.open_memory_channel[str](config.subscription_buffer)
        self._gone_send, self._gone_receive = trio.open_memory_channel[str](config.subscription_buffer)
        self.nat: NatService | None = None

    def reachability(self) -> Reachability:
        return self.nat.reachability() if self.nat is not None else Reachability(reason="NAT checks are off")

    def is_direct(self, peer_id: str) -> bool:
        return self.nat is None or self.nat.is_direct(peer_id)

    def listen_addrs(self) -> list[str]:
        return [str(addr) for addr in self._host.get_addrs()]

    async def connect(self, addr: str) -> str:
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:  # multiaddr parsing raises several unrelated kinds
            raise ValueError(f"{addr!r} is not a multiaddr ending in /p2p/<peer id>: {exc}") from None
        peer_id = str(info.peer_id)
        if peer_id == self.peer_id:
            raise ValueError(f"{addr!r} is this host's own address")
        timeout_s = self._config.dial_timeout_s
        try:
            with trio.fail_after(timeout_s):
                if "/p2p-circuit" in addr and self.nat is not None:
                    await self.nat.dial_relayed(addr)
                else:
                    await self._host.connect(info)
        except trio.TooSlowError:
            raise PeerUnreachable(f"dialing {addr} timed out after {timeout_s} s") from None
        except Exception as exc:  # the one place dial failures (swarm, transport, handshake) are mapped
            raise PeerUnreachable(f"dialing {addr} failed: {exc!r}") from exc
        return peer_id

    async def disconnect(self, peer_id: str) -> None:
        pid = _to_id(peer_id)
        network = self._host.get_network()
        with trio.move_on_after(DISCONNECT_TIMEOUT_S):
            try:
                await self._host.disconnect(pid)
            except _STREAM_ERRORS as exc:
                logger.debug("disconnect from %s: %r", peer_id, exc)
        # Over a cut link yamux's close waits for its GO_AWAY to drain, which it never does, and
        # the swarm keeps listing the connection: the peer looks connected, is never redialled,
        # and streams to it wait out their timeouts. Close the socket under it and forget it.
        for conn in list(network.get_connections(pid)):
            with trio.move_on_after(DISCONNECT_TIMEOUT_S):
                try:
                    await conn.muxed_conn.secured_conn.close()
                except Exception as exc:  # whatever a half-dead transport raises; it is being dropped
                    logger.debug("closing the socket to %s: %r", peer_id, exc)
            network.remove_conn(conn)
        # Pubsub forgets a peer only if its dead-peer task finds no connection left, and it looks
        # before the swarm has dropped the closed ones: the peer's stale stream then stays
        # registered, a reconnection is "already" registered, no subscriptions are exchanged
        # and gossip to and from it is queued for good. Forget it here once it is gone.
        if pid in self._pubsub.peers and not self._host.get_network().get_connections(pid):
            self._pubsub._handle_dead_peer(pid)

    def connected_peers(self) -> list[str]:
        return [str(pid) for pid in self._host.get_connected_peers()]

    def set_offence_handler(self, handler: OffenceHandler | None) -> None:
        self._offences.set_handler(handler)

    async def block_peer(self, peer_id: str, duration_s: float) -> None:
        _to_id(peer_id)  # a ValueError for junk, before anything changes
        self._gate.block(peer_id, duration_s)
        await self.disconnect(peer_id)

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        async def serve(raw: Any) -> None:
            # An exception escaping here would tear down the whole libp2p host (notes §3.5).
            remote = str(raw.muxed_conn.peer_id)
            stream = _Stream(raw, remote, protocol, self._stats)
            self._stats.streams_accepted += 1
            if self._gate.is_blocked(remote):
                await stream.reset()
                return
            if stream._relayed and protocol in self._config.direct_only_protocols:
                self._stats.relayed_streams_refused += 1  # bulk data never crosses a relay
                with trio.move_on_after(CLEANUP_S, shield=True):
                    await stream.reset()
                return
            try:
                await handler(stream)
            except Exception as exc:
                self._stats.handler_errors += 1
                # A stream the peer or network broke is routine; anything else is a bug worth a warning.
                level = logging.DEBUG if isinstance(exc, TransportError) else logging.WARNING
                logger.log(level, "handler for %s from %s failed", protocol, remote, exc_info=True)
                with trio.move_on_after(CLEANUP_S, shield=True):
                    await stream.reset()
                return
            with trio.move_on_after(CLEANUP_S, shield=True):
                try:
                    await raw.close()
                except _STREAM_ERRORS:
                    pass  # the peer may already have reset it

        self._host.set_stream_handler(TProtocol(protocol), serve)

    async def open_stream(self, peer_id: str, protocol: str | Sequence[str]) -> _Stream:
        pid = _to_id(peer_id)
        timeout_s = self._config.stream_open_timeout_s
        choices = [protocol] if isinstance(protocol, str) else list(protocol)
        if not choices:
            raise ValueError("open_stream needs at least one protocol")
        if any(p in self._config.direct_only_protocols for p in choices) and not self.is_direct(peer_id):
            self._stats.relayed_streams_refused += 1
            raise PeerUnreachable(f"no direct connection to {peer_id}: {choices[0]} never runs over a relay")
        try:
            with trio.fail_after(timeout_s):
                raw = await self._host.new_stream(pid, [TProtocol(p) for p in choices])
        except trio.TooSlowError:
            raise PeerUnreachable(f"opening {choices[0]} to {peer_id} timed out after {timeout_s} s") from None
        except Exception as exc:  # StreamFailure (protocol refused), dial and swarm errors
            raise PeerUnreachable(f"opening {choices[0]} to {peer_id} failed: {exc!r}") from exc
        self._stats.streams_opened += 1
        chosen = str(raw.get_protocol() or choices[0])
        return _Stream(raw, peer_id, chosen, self._stats)

    def subscribe(self, topic: str, validator: GossipValidator | None = None) -> trio.MemoryReceiveChannel[GossipMessage]:
        if topic in self._joined:
            raise ValueError(f"already subscribed to {topic!r}; subscribe once per topic")
        self._joined[topic] = trio.Event()
        send, receive = trio.open_memory_channel[GossipMessage](self._config.subscription_buffer)
        # Installed even without a user validator: it is the only place that sees the forwarder.
        self._pubsub.set_topic_validator(topic, self._wrap_validator(topic, validator), is_async_validator=False)
        self._nursery.start_soon(self._run_subscription, topic, send)
        return receive

    def _wrap_validator(self, topic: str, validator: GossipValidator | None):
        def validate(forwarder: ID, msg: Any) -> bool:
            # An exception escaping a validator tears down pubsub and the host (notes §3.5).
            try:
                if self._gate.is_blocked(str(forwarder)):
                    accepted = False
                elif len(msg.data) > self._config.max_gossip_bytes:
                    accepted = False
                    self._offences.report(forwarder, "gossip_oversize")
                else:
                    gossip = GossipMessage(topic=topic, data=bytes(msg.data), forwarder=str(forwarder),
                                           origin=str(ID(msg.from_id)))
                    accepted = validator is None or bool(validator(gossip))
                if accepted:
                    self._remember_forwarder(get_peer_and_seqno_msg_id(msg), str(forwarder))
            except Exception:
                logger.warning("validator for %s raised; message rejected", topic, exc_info=True)
                accepted = False
            if not accepted:
                self._stats.gossip_rejected += 1
            return accepted

        return validate

    def _remember_forwarder(self, msg_id: bytes, forwarder: str) -> None:
        self._forwarders[msg_id] = forwarder
        while len(self._forwarders) > MAX_PENDING_FORWARDERS:
            self._forwarders.popitem(last=False)

    async def _run_subscription(self, topic: str, send: trio.MemorySendChannel[GossipMessage]) -> None:
        """Hand each accepted message straight to our bounded channel, dropping (and counting) on overflow.

        py-libp2p runs every incoming message in its own task (push_msg) and puts it in a 32-deep
        channel per topic. A burst of more than 32 messages in one scheduling batch (a peer
        re-announcing its shards, a backlog after a busy moment) then overflows that channel before
        any consumer can run, and libp2p drops each extra message with a warning. Its channel is
        therefore replaced by a direct hand-off: our channel (subscription_buffer deep) is the only
        queue, and its drops are counted in gossip_dropped_queue_full.
        """
        async with send:
            subscription = await self._pubsub.subscribe(topic)
            self._pubsub.subscribed_topics_send[topic] = _DirectDelivery(lambda msg: self._deliver_safely(topic, msg, send))
            while True:  # whatever arrived while subscribe() was announcing us
                try:
                    self._deliver_safely(topic, subscription.receive_channel.receive_nowait(), send)
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
            self._joined[topic].set()
            await trio.sleep_forever()  # the channel stays open for the host's lifetime

    def _deliver_safely(self, topic: str, msg: Any, send: trio.MemorySendChannel[GossipMessage]) -> None:
        try:
            self._deliver(topic, msg, send)
        except Exception:  # runs inside libp2p's push_msg: an exception there would tear down pubsub
            logger.warning("dropping a malformed message on %s", topic, exc_info=True)

    def _deliver(self, topic: str, msg: Any, send: trio.MemorySendChannel[GossipMessage]) -> None:
        origin = str(ID(msg.from_id))
        msg_id = get_peer_and_seqno_msg_id(msg)
        forwarder = self._forwarders.pop(msg_id, origin)
        if origin == self.peer_id:
            return
        try:
            send.send_nowait(GossipMessage(topic=topic, data=bytes(msg.data), forwarder=forwarder, origin=origin))
        except (trio.WouldBlock, trio.BrokenResourceError):
            self._stats.gossip_dropped_queue_full += 1
            return
        self._stats.gossip_received += 1

    async def publish(self, topic: str, data: bytes) -> None:
        if len(data) > self._config.max_gossip_bytes:
            raise ValueError(f"gossip payload of {len(data)} bytes exceeds max_gossip_bytes={self._config.max_gossip_bytes}")
        # One publish at a time, each after the peers' send queues have room: py-libp2p queues at
        # most 32 RPCs per peer and silently drops the rest, so a burst of publishes (or heartbeats
        # behind one) would vanish instead of waiting its turn.
        async with self._publish_lock:
            await self._wait_for_outbound_room()
            try:
                await self._pubsub.publish(topic, bytes(data))
            except Exception as exc:  # the one place pubsub's publish failures are mapped
                raise TransportError(f"publishing on {topic} failed: {exc!r}") from exc
        self._stats.gossip_published += 1

    async def _wait_for_outbound_room(self) -> None:
        """Until every peer's outbound RPC queue has room, or PUBLISH_WAIT_S.

        A peer that let a whole wait pass without draining is skipped by later publishes until its
        queue has room again: one peer that stops reading must not slow every publish to a crawl.
        """
        deadline = trio.current_time() + PUBLISH_WAIT_S
        while True:
            queues = getattr(self._pubsub, "peer_queues", {})
            full = {pid for pid, q in list(queues.items()) if len(q) >= OUTBOUND_QUEUE_LIMIT}
            self._stuck_peers &= full
            if not full - self._stuck_peers:
                return
            if trio.current_time() >= deadline:
                self._stuck_peers |= full
                logger.warning("gossip: %d peer(s) not draining their queues; publishing without waiting for them",
                               len(full))
                return
            await trio.sleep(OUTBOUND_POLL_S)

    async def wait_for_topic_peer(self, topic: str, peer_id: str) -> None:
        pid = _to_id(peer_id)
        joined = self._joined.get(topic)
        if joined is not None:
            # Subscribed topics send only to mesh peers; the mesh exists once our join ran.
            await joined.wait()
            await self._pubsub.wait_for_mesh(pid, topic, timeout=math.inf)
        else:
            await self._pubsub.wait_for_subscription(pid, topic, timeout=math.inf)

    def discovered(self) -> trio.MemoryReceiveChannel[str]:
        return self._discovered_receive

    def disconnections(self) -> trio.MemoryReceiveChannel[str]:
        return self._gone_receive

    def _on_disconnected(self, conn: Any) -> None:
        pid = conn.muxed_conn.peer_id
        if self._host.get_network().get_connections(pid):
            return  # another connection to the peer is still open
        try:
            self._gone_send.send_nowait(str(pid))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _on_peer_discovered(self, info: PeerInfo) -> list[str]:
        """Runs on the trio thread: queue the peer's dialable addresses, never ours."""
        if str(info.peer_id) == self.peer_id:
            return []
        suffix = f"/p2p/{info.peer_id}"
        # A peer's 0.0.0.0 (what py-libp2p's mDNS puts in its records) would dial ourselves.
        addrs = [str(a) if str(a).endswith(suffix) else str(a) + suffix for a in info.addrs
                 if not is_unspecified(str(a))]
        for addr in addrs:
            try:
                self._discovered_send.send_nowait(addr)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the node is not draining discovery; the peer will be announced again
        return addrs

    def statistics(self) -> HostStatistics:
        s = self._stats
        return dataclasses.replace(s, connected_peers=len(self._host.get_connected_peers()),
                                   bytes_sent_by_peer=dict(s.bytes_sent_by_peer),
                                   bytes_received_by_peer=dict(s.bytes_received_by_peer),
                                   offences=dict(self._offences.by_reason), blocked_peers=len(self._gate.blocked()),
                                   relayed_bytes_by_protocol=dict(s.relayed_bytes_by_protocol),
                                   gossip_bytes_sent_by_kind=dict(s.gossip_bytes_sent_by_kind))


async def _no_auto_dial() -> None:
    return None


def _build_libp2p(keypair: Keypair, config: HostConfig) -> tuple[Any, GossipSub, Pubsub, Offences, PeerGate]:
    key_pair = ed25519_key_pair(keypair.seed)
    raw_host = new_host(
        key_pair=key_pair,
        # Only Noise and Yamux: the defaults also accept plaintext (no key proof), secio and mplex.
        sec_opt={NOISE_ID: NoiseTransport(key_pair, noise_privkey=x25519_key_pair().private_key)},
        muxer_opt={TProtocol(YAMUX_ID): Yamux},
        # One connection per peer also removes the 250 ms happy-eyeballs wait on every dial.
        connection_config=ConnectionConfig(
            max_connections_per_peer=1, max_connections=config.max_connections,
            high_watermark=config.max_connections, low_watermark=0, min_connections=0,
            dial_timeout=config.dial_timeout_s,
        ),
        enable_mDNS=config.mdns,
    )
    if raw_host.mDNS is not None:
        advertise_dialable_over_mdns(raw_host.mDNS.broadcaster)
    # libp2p's auto-connector redials any peer in the peerstore (identify, mDNS, past peers) whenever
    # the count is below a watermark; the node alone decides whom to dial, so it never runs.
    raw_host.get_network().auto_connector.maybe_connect = _no_auto_dial
    degree = config.gossip_degree
    gossipsub = GossipSub(
        protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11, MESHSUB_10],
        degree=degree, degree_low=max(1, degree - 2), degree_high=2 * degree,
        heartbeat_interval=config.gossip_heartbeat_s,  # type: ignore[arg-type]  # a float sleeps fine
        adaptive_gossip_enabled=False, spam_protection_enabled=False, eclipse_protection_enabled=False,
    )
    max_rpc_bytes = max(1 << 20, 2 * config.max_gossip_bytes + GOSSIP_RPC_OVERHEAD_BYTES)
    pubsub = Pubsub(raw_host, gossipsub, strict_signing=True, max_inbound_rpc_size=max_rpc_bytes)
    # Message ids are (publisher, sequence number), and py-libp2p starts the number at the clock's
    # seconds, one per message: a node that published more than one message a second and restarts
    # reuses numbers its previous incarnation sent, and its peers drop its new messages as already
    # seen for the seen cache's lifetime (a restarted node was marked dead while it answered hellos,
    # and its task messages were lost). go-libp2p starts at the clock's nanoseconds; so do we.
    pubsub.counter = time.time_ns()
    fix_prune_backoff(gossipsub)
    idontwant_for_large_messages_only(gossipsub)
    offences = Offences()
    fix_inbound_slots(raw_host, offences)
    protect_peerstore(raw_host)
    guard_swarm_streams(raw_host, offences)
    guard_identify_push(raw_host, offences)
    guard_pubsub(raw_host, pubsub, offences, max_message_bytes=config.max_gossip_bytes)
    return raw_host, gossipsub, pubsub, offences, PeerGate(raw_host, pubsub, offences)


@asynccontextmanager
async def open_host(keypair: Keypair, config: HostConfig | None = None) -> AsyncIterator[Libp2pHost]:
    """Run a libp2p host until the block exits; connections to peers are closed on the way out."""
    config = config or HostConfig()
    batch_window_updates()
    listen = [multiaddr.Multiaddr(a) for a in config.listen_addrs]
    raw_host, gossipsub, pubsub, offences, gate = _build_libp2p(keypair, config)
    stats = HostStatistics()
    count_wire_bytes(raw_host, stats)  # before the first connection, inbound ones included
    write_whole_frames(raw_host)
    omit_sender_records(pubsub)
    count_gossip_bytes(pubsub, stats)  # what is written, the record left out
    # The teardown scope encloses every context below, so cleanup can be shielded and bounded
    # without exiting a nursery from inside a younger cancel scope.
    with trio.CancelScope() as teardown:
        stack = AsyncExitStack()
        on_discovered = None
        nursery = None
        try:
            await stack.enter_async_context(raw_host.run(listen))
            await stack.enter_async_context(background_trio_service(pubsub))
            await stack.enter_async_context(background_trio_service(gossipsub))
            await pubsub.wait_until_ready()
            nursery = await stack.enter_async_context(trio.open_nursery())
            host = Libp2pHost(keypair, config, raw_host, pubsub, nursery, offences, gate, stats)
            raw_host.get_network().register_notifee(ConnectionEvents(on_disconnected=host._on_disconnected))
            if config.nat:
                host.nat = await nursery.start(NatService(raw_host, config).run)
            if config.mdns:
                on_discovered = _thread_forwarder(host, trio.lowlevel.current_trio_token())
                peerDiscovery.register_peer_discovered_handler(on_discovered)
            yield host
        finally:
            teardown.shield = True
            teardown.deadline = trio.current_time() + CLEANUP_S
            if on_discovered is not None:
                peerDiscovery.unregister_peer_discovered_handler(on_discovered)
            await _shutdown(raw_host, stack, nursery)
    if teardown.cancelled_caught:
        logger.warning("libp2p host shutdown exceeded %s s; abandoned", CLEANUP_S)


def _thread_forwarder(host: Libp2pHost, token: trio.lowlevel.TrioToken):
    """The mDNS callback: zeroconf calls it on its own threads, and the registry is shared by every host."""

    def on_discovered(info: PeerInfo) -> None:
        try:
            token.run_sync_soon(host._on_peer_discovered, info)
        except trio.RunFinishedError:
            pass  # the trio run that owned this host is gone

    return on_discovered


async def _shutdown(raw_host: Any, stack: AsyncExitStack, nursery: trio.Nursery | None) -> None:
    """Close the host before pubsub stops, or in-flight RPCs hit a closed nursery (notes §3.4, §4 item 8).

    An outer cancellation may already have cancelled libp2p's service nurseries, which enclose
    this code: the close gets its own shield, and the stack is unwound whatever happens, since
    leaving those contexts open would corrupt trio's cancel-scope stack. Our nursery is cancelled
    only right before the stack exits it, or the host's close would be cancelled with it.
    """
    try:
        with trio.move_on_after(CLEANUP_S, shield=True):
            await raw_host.close()
    except Exception:
        logger.debug("error while closing the libp2p host", exc_info=True)
    finally:
        if nursery is not None:
            nursery.cancel_scope.cancel()
        try:
            await stack.aclose()  # exits in reverse: our nursery, gossipsub, pubsub, host.run
        except* Exception as group:  # teardown noise from libp2p's services; nothing is running any more
            if group.subgroup(lambda exc: "stack corrupted" in str(exc)) is not None:
                raise  # a misnested scope is our bug and leaves trio unusable: never hide it
            logger.debug("libp2p shutdown noise: %r", group)
