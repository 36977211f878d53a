"""An in-memory swarm with p2p.api's semantics (streams, gossip, statistics, faults) for fast unit tests."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict, deque
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator, Sequence

import trio

from p2p.api import GossipMessage, GossipValidator, HostConfig, HostStatistics, Reachability, StreamHandler
from protocol.errors import PeerUnreachable, StreamClosed, TransportError
from protocol.keys import Keypair

logger = logging.getLogger(__name__)

STREAM_BUFFER_BYTES = 256 * 1024
"""Per-direction buffer, like yamux's initial receive window: a writer blocks once it is full."""

MAX_SEEN_MESSAGES = 10_000


class _Pipe:
    """One direction of a stream: a bounded byte buffer with EOF and reset."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.buffer = bytearray()
        self.eof = False
        self.broken = False
        self._lot = trio.lowlevel.ParkingLot()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        view = memoryview(data).cast("B")
        while view:
            if self.broken:
                raise StreamClosed("stream was reset")
            if self.eof:
                raise StreamClosed("stream is closed for writing")
            room = self.capacity_bytes - len(self.buffer)
            if room <= 0:
                await self._lot.park()
                continue
            self.buffer += view[:room]
            view = view[room:]
            self._lot.unpark_all()

    async def read(self, max_bytes: int) -> bytes:
        await trio.lowlevel.checkpoint()
        while True:
            if self.broken:
                raise StreamClosed("stream was reset")
            if self.buffer:
                data = bytes(self.buffer[:max_bytes])
                del self.buffer[:max_bytes]
                self._lot.unpark_all()
                return data
            if self.eof:
                return b""
            await self._lot.park()

    def close(self) -> None:
        self.eof = True
        self._lot.unpark_all()

    def break_(self) -> None:
        # Unread data is lost, as with yamux when a stream resets or its connection dies.
        self.broken = True
        self.buffer.clear()
        self._lot.unpark_all()


class FakeStream:
    """One end of an in-memory stream; the same contract as p2p.api.Stream."""

    def __init__(self, owner: "FakeHost", remote_peer: str, protocol: str, incoming: _Pipe, outgoing: _Pipe):
        self._owner = owner
        self.remote_peer = remote_peer
        self.protocol = protocol
        self._in = incoming
        self._out = outgoing

    async def read(self, max_bytes: int) -> bytes:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, not {max_bytes}")
        data = await self._in.read(max_bytes)
        stats = self._owner._stats
        stats.bytes_received += len(data)
        stats.wire_bytes_received += len(data)  # no framing in memory: the wire is the payload
        stats.bytes_received_by_peer[self.remote_peer] = stats.bytes_received_by_peer.get(self.remote_peer, 0) + len(data)
        return data

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await self._out.write(data)
        stats = self._owner._stats
        stats.bytes_sent += len(data)
        stats.wire_bytes_sent += len(data)
        stats.bytes_sent_by_peer[self.remote_peer] = stats.bytes_sent_by_peer.get(self.remote_peer, 0) + len(data)

    async def close_write(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._out.broken:
            raise StreamClosed("stream was reset")
        self._out.close()

    async def close(self) -> None:
        await self.close_write()
        self._owner._streams.discard(self)

    async def reset(self) -> None:
        await trio.lowlevel.checkpoint()
        self._break()

    def _break(self) -> None:
        self._in.break_()
        self._out.break_()
        self._owner._streams.discard(self)


class FakeHost:
    """p2p.api.Host in memory; obtain one from FakeNetwork.open_host."""

    def __init__(self, network: "FakeNetwork", peer_id: str, addr: str, config: HostConfig, nursery: trio.Nursery):
        self.peer_id = peer_id
        self._network = network
        self._addr = addr
        self._config = config
        self._nursery = nursery
        self._stats = HostStatistics()
        self._links: set[str] = set()
        self._streams: set[FakeStream] = set()
        self._handlers: dict[str, StreamHandler] = {}
        self._subs: dict[str, tuple[trio.MemorySendChannel[GossipMessage], GossipValidator | None]] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._seqno = 0
        self._alive = True
        self._blocked_until: dict[str, float] = {}
        self._offence_handler = None
        self._discovered_send, self._discovered_receive = trio.open_memory_channel[str](config.subscription_buffer)
        self._gone_send, self._gone_receive = trio.open_memory_channel[str](config.subscription_buffer)

    def listen_addrs(self) -> list[str]:
        return [self._addr]

    async def connect(self, addr: str) -> str:
        await trio.lowlevel.checkpoint()
        peer_id = self._network._parse_addr(addr)
        if peer_id == self.peer_id:
            raise ValueError(f"{addr!r} is this host's own address")
        remote = self._network._reachable(self, peer_id)
        if remote is None:
            raise PeerUnreachable(f"dialing {addr} failed: no such peer, or it is partitioned away")
        if self._is_blocked(peer_id) or remote._is_blocked(self.peer_id):
            raise PeerUnreachable(f"dialing {addr} failed: the connection was refused (banned)")
        self._links.add(peer_id)
        remote._links.add(self.peer_id)
        self._network._notify()
        return peer_id

    async def disconnect(self, peer_id: str) -> None:
        await trio.lowlevel.checkpoint()
        self._network._sever(self.peer_id, peer_id)

    def connected_peers(self) -> list[str]:
        return sorted(self._links)

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler

    def set_offence_handler(self, handler) -> None:
        self._offence_handler = handler  # the fake never parses wire bytes, so it never calls it

    async def block_peer(self, peer_id: str, duration_s: float) -> None:
        if not peer_id or "/" in peer_id:
            raise ValueError(f"{peer_id!r} is not a peer id")
        self._blocked_until[peer_id] = trio.current_time() + duration_s
        await self.disconnect(peer_id)

    def _is_blocked(self, peer_id: str) -> bool:
        until = self._blocked_until.get(peer_id)
        if until is not None and trio.current_time() >= until:
            del self._blocked_until[peer_id]
            return False
        return until is not None

    async def open_stream(self, peer_id: str, protocol: str | Sequence[str]) -> FakeStream:
        await trio.lowlevel.checkpoint()
        choices = [protocol] if isinstance(protocol, str) else list(protocol)
        if not choices:
            raise ValueError("open_stream needs at least one protocol")
        remote = self._network._hosts.get(peer_id)
        if remote is None or peer_id not in self._links or not self._alive or not remote._alive:
            raise PeerUnreachable(f"opening {choices[0]} to {peer_id} failed: not connected")
        # As multistream-select: the first of ours, in our order, that the peer serves.
        protocol = next((p for p in choices if p in remote._handlers), None)
        if protocol is None:
            raise PeerUnreachable(f"opening {choices[0]} to {peer_id} failed: the peer does not serve it")
        handler = remote._handlers[protocol]
        capacity = self._network.stream_buffer_bytes
        to_remote, to_local = _Pipe(capacity), _Pipe(capacity)
        local_end = FakeStream(self, peer_id, protocol, to_local, to_remote)
        remote_end = FakeStream(remote, self.peer_id, protocol, to_remote, to_local)
        self._streams.add(local_end)
        remote._streams.add(remote_end)
        self._stats.streams_opened += 1
        remote._stats.streams_accepted += 1
        remote._nursery.start_soon(remote._serve, handler, remote_end)
        return local_end

    async def _serve(self, handler: StreamHandler, stream: FakeStream) -> None:
        if self._is_blocked(stream.remote_peer):
            stream._break()
            return
        try:
            await handler(stream)
        except Exception as exc:
            self._stats.handler_errors += 1
            level = logging.DEBUG if isinstance(exc, TransportError) else logging.WARNING
            logger.log(level, "handler for %s from %s failed", stream.protocol, stream.remote_peer, exc_info=True)
            stream._break()
            return
        if not stream._out.broken:
            stream._out.close()
        self._streams.discard(stream)

    def subscribe(self, topic: str, validator: GossipValidator | None = None) -> trio.MemoryReceiveChannel[GossipMessage]:
        if topic in self._subs:
            raise ValueError(f"already subscribed to {topic!r}; subscribe once per topic")
        send, receive = trio.open_memory_channel[GossipMessage](self._config.subscription_buffer)
        self._subs[topic] = (send, validator)
        self._network._notify()
        return receive

    async def publish(self, topic: str, data: bytes) -> None:
        if len(data) > self._config.max_gossip_bytes:
            raise ValueError(f"gossip payload of {len(data)} bytes exceeds max_gossip_bytes={self._config.max_gossip_bytes}")
        await trio.lowlevel.checkpoint()
        self._seqno += 1
        self._network._flood(self, topic, bytes(data), (self.peer_id, self._seqno))
        self._stats.gossip_published += 1

    async def wait_for_topic_peer(self, topic: str, peer_id: str) -> None:
        while True:
            remote = self._network._hosts.get(peer_id)
            if remote is not None and peer_id in self._links and topic in remote._subs:
                return
            await self._network._changed.wait()

    def _accept(self, topic: str, data: bytes, forwarder: str, origin: str, msg_id: tuple[str, int]) -> bool:
        """Validate and deliver one copy; True when it should be relayed further."""
        if msg_id in self._seen or self._is_blocked(forwarder):
            return False
        send, validator = self._subs.get(topic, (None, None))
        message = GossipMessage(topic=topic, data=data, forwarder=forwarder, origin=origin)
        try:
            accepted = len(data) <= self._config.max_gossip_bytes and (validator is None or bool(validator(message)))
        except Exception:
            logger.warning("validator for %s raised; message rejected", topic, exc_info=True)
            accepted = False
        if not accepted:
            self._stats.gossip_rejected += 1
            return False
        self._seen[msg_id] = None
        while len(self._seen) > MAX_SEEN_MESSAGES:
            self._seen.popitem(last=False)
        if send is not None and origin != self.peer_id:
            try:
                send.send_nowait(message)
                self._stats.gossip_received += 1
            except (trio.WouldBlock, trio.BrokenResourceError):
                self._stats.gossip_dropped_queue_full += 1
        return True

    def discovered(self) -> trio.MemoryReceiveChannel[str]:
        return self._discovered_receive

    def disconnections(self) -> trio.MemoryReceiveChannel[str]:
        return self._gone_receive

    def statistics(self) -> HostStatistics:
        s = self._stats
        return dataclasses.replace(s, connected_peers=len(self._links), bytes_sent_by_peer=dict(s.bytes_sent_by_peer),
                                   bytes_received_by_peer=dict(s.bytes_received_by_peer),
                                   gossip_bytes_sent_by_kind=dict(s.gossip_bytes_sent_by_kind),
                                   blocked_peers=sum(self._is_blocked(p) for p in list(self._blocked_until)))

    def reachability(self) -> Reachability:
        # The in-memory network has no NAT: every host can be reached by every other.
        return Reachability(status="public", reason="in-memory network (no NAT)")

    def is_direct(self, peer_id: str) -> bool:
        return True


class FakeNetwork:
    """The shared medium of FakeHosts, with fault injection: partition(), heal(), kill()."""

    def __init__(self, *, stream_buffer_bytes: int = STREAM_BUFFER_BYTES):
        self.stream_buffer_bytes = stream_buffer_bytes
        self._hosts: dict[str, FakeHost] = {}
        self._by_addr: dict[str, str] = {}
        self._partitions: set[frozenset[str]] = set()
        self._next_index = 0
        self._changed = trio.Event()

    @asynccontextmanager
    async def open_host(self, keypair: Keypair, config: HostConfig | None = None) -> AsyncIterator[FakeHost]:
        config = config or HostConfig()
        peer_id = keypair.peer_id
        if peer_id in self._hosts:
            raise ValueError(f"a host with peer id {peer_id} is already running on this FakeNetwork")
        addr = f"/memory/{self._next_index}/p2p/{peer_id}"
        self._next_index += 1
        # The nursery is left through an exit stack so an error in the caller's block is not wrapped in a group.
        stack = AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        host = FakeHost(self, peer_id, addr, config, nursery)
        self._hosts[peer_id] = host
        if config.mdns:
            self._announce(host)
        try:
            yield host
        finally:
            self.kill(peer_id)
            del self._hosts[peer_id]
            for send, _ in host._subs.values():
                send.close()
            host._discovered_send.close()
            host._gone_send.close()
            nursery.cancel_scope.cancel()
            await stack.aclose()

    def partition(self, a: str, b: str) -> None:
        """Cut the link between two peers and refuse new dials between them until heal()."""
        self._partitions.add(frozenset((a, b)))
        self._sever(a, b)

    def heal(self, a: str, b: str) -> None:
        self._partitions.discard(frozenset((a, b)))

    def kill(self, peer_id: str) -> None:
        """Drop a host abruptly, as if its process was SIGKILLed: links cut, streams reset, unreachable."""
        host = self._hosts.get(peer_id)
        if host is None:
            return
        host._alive = False
        for other in list(host._links):
            self._sever(peer_id, other)
        for stream in list(host._streams):
            stream._break()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _parse_addr(self, addr: str) -> str:
        parts = addr.split("/")
        if len(parts) != 5 or parts[0] or parts[1] != "memory" or parts[3] != "p2p" or not parts[4]:
            raise ValueError(f"{addr!r} is not a /memory/<n>/p2p/<peer id> address")
        return parts[4]

    def _reachable(self, local: FakeHost, peer_id: str) -> FakeHost | None:
        remote = self._hosts.get(peer_id)
        if remote is None or not remote._alive or not local._alive:
            return None
        if frozenset((local.peer_id, peer_id)) in self._partitions:
            return None
        return remote

    def _sever(self, a: str, b: str) -> None:
        host_a, host_b = self._hosts.get(a), self._hosts.get(b)
        for host, other in ((host_a, b), (host_b, a)):
            if host is None:
                continue
            if other in host._links:
                host._links.discard(other)
                try:
                    host._gone_send.send_nowait(other)
                except (trio.WouldBlock, trio.ClosedResourceError):
                    pass
            for stream in [s for s in host._streams if s.remote_peer == other]:
                stream._break()
        self._notify()

    def _flood(self, origin: FakeHost, topic: str, data: bytes, msg_id: tuple[str, int]) -> None:
        """Relay like gossipsub: only through peers subscribed to the topic, each copy validated once."""
        if not origin._accept(topic, data, origin.peer_id, origin.peer_id, msg_id):
            return
        queue = deque([origin])
        for _ in range(len(self._hosts) + 1):  # each host relays a message at most once
            if not queue:
                break
            relay = queue.popleft()
            for peer_id in sorted(relay._links):
                peer = self._hosts.get(peer_id)
                if peer is None or not peer._alive or topic not in peer._subs or peer_id == origin.peer_id:
                    continue
                relay._stats.wire_bytes_sent += len(data)  # every copy crosses a link, duplicates too
                by_kind = relay._stats.gossip_bytes_sent_by_kind
                by_kind[topic] = by_kind.get(topic, 0) + len(data)
                peer._stats.wire_bytes_received += len(data)
                if peer._accept(topic, data, relay.peer_id, origin.peer_id, msg_id):
                    queue.append(peer)

    def _announce(self, host: FakeHost) -> None:
        for other in self._hosts.values():
            if other is host or not other._config.mdns:
                continue
            for receiver, sender in ((other, host), (host, other)):
                try:
                    receiver._discovered_send.send_nowait(sender._addr)
                except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                    pass
