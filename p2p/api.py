"""The interface the rest of Shoal uses for the network; implemented by p2p.host (libp2p) and p2p.fake.

Nothing here imports libp2p. Peer ids and addresses are plain strings at this boundary.
Errors are the ones from protocol.errors: PeerUnreachable, StreamClosed, TransferTimeout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable, Protocol, Sequence

import trio


class Stream(Protocol):
    """One bidirectional byte stream to a peer (a yamux stream over Noise on the libp2p host).

    read() returns 1..max_bytes bytes, or b"" once the peer has half-closed; a reset or dead
    connection raises StreamClosed. write() raises StreamClosed if the stream is gone and blocks
    while the peer's receive window is full. close_write() sends EOF and keeps the read side open;
    close() ends our side for good; reset() aborts both directions. None of these take a
    timeout: callers wrap them in trio.fail_after / move_on_after.

    Data the peer has not read yet is lost when the connection goes down (yamux): a sender must
    wait for an application-level ack before it disconnects or shuts its host down.
    """

    remote_peer: str
    protocol: str

    async def read(self, max_bytes: int) -> bytes: ...
    async def write(self, data: bytes | bytearray | memoryview) -> None: ...
    async def close_write(self) -> None: ...
    async def close(self) -> None: ...
    async def reset(self) -> None: ...


StreamHandler = Callable[[Stream], Awaitable[None]]
"""Serves one inbound stream. Any exception it raises is contained and counted by the host."""


@dataclass(frozen=True, slots=True)
class GossipMessage:
    topic: str
    data: bytes
    forwarder: str
    """The peer that handed us this copy (the one to penalize for junk)."""
    origin: str
    """The peer that published it (authenticated by gossipsub's strict signing)."""


OffenceHandler = Callable[[str, str], None]
"""Called as handler(peer_id, reason) for input a peer sent that the host refused below the node's
handlers (broken gossip RPCs, bad signatures, failing library streams). Must not raise or block."""

GossipValidator = Callable[[GossipMessage], bool]
"""Decides whether a message is accepted and relayed. Must be cheap; an exception counts as False."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reachability:
    """Whether peers can dial this host, as learned from their dial-backs on fresh connections."""

    status: str = "unknown"
    """public, private or unknown."""
    reason: str = "not checked"
    observed_ips: tuple[str, ...] = ()
    """The address(es) peers see our connections come from (our NAT's public side when private)."""
    public_addrs: tuple[str, ...] = ()
    """Addresses that peers have dialed back successfully."""
    relay_addrs: tuple[str, ...] = ()
    """/p2p-circuit addresses through the relays holding a reservation for us."""
    relaying: bool = False
    """Whether we serve as a circuit relay for others."""
    dial_backs_ok: int = 0
    dial_backs_failed: int = 0
    port_mapping: dict = field(default_factory=dict)
    """The router's port mapping for us (p2p.portmap.MappingState), empty while port mapping is off."""

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(kw_only=True)
class HostConfig:
    listen_addrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    mdns: bool = False
    dial_timeout_s: float = 10.0
    stream_open_timeout_s: float = 10.0
    gossip_heartbeat_s: float = 1.0
    gossip_degree: int = 6
    max_gossip_bytes: int = 256 * 1024
    subscription_buffer: int = 1024
    max_connections: int = 200
    nat: bool = False
    """Check reachability, use relays when private, punch holes (p2p.nat)."""
    relay_service: bool = True
    """With nat: serve as a limited circuit relay once peers confirm we are public."""
    direct_only_protocols: tuple[str, ...] = ()
    """Protocols (bulk data) that never run over a relayed connection, in either direction."""
    port_mapping: bool = False
    """With nat: ask the home router (NAT-PMP, then UPnP IGD) to forward the listen port (p2p.portmap)."""
    port_mapping_gateway: str = ""
    """The router to ask, "ip" or "ip:port" (NAT-PMP's port); empty: the default route's gateway."""


@dataclass(kw_only=True)
class HostStatistics:
    connected_peers: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_sent_by_peer: dict[str, int] = field(default_factory=dict)
    bytes_received_by_peer: dict[str, int] = field(default_factory=dict)
    wire_bytes_sent: int = 0
    """Every byte written to the host's TCP connections: our streams' payload and all that libp2p adds
    (negotiation, Noise, Yamux framing, gossip, identify, ping). See p2p.wire."""
    wire_bytes_received: int = 0
    gossip_bytes_sent_by_kind: dict[str, int] = field(default_factory=dict)
    """Gossip this host wrote, by topic (messages, forwarded copies included), "control" and "subscriptions"."""
    gossip_published: int = 0
    gossip_received: int = 0
    gossip_rejected: int = 0
    gossip_dropped_queue_full: int = 0
    handler_errors: int = 0
    streams_opened: int = 0
    streams_accepted: int = 0
    offences: dict[str, int] = field(default_factory=dict)
    """Input refused inside the host, by reason (also handed to the offence handler)."""
    blocked_peers: int = 0
    relayed_bytes_by_protocol: dict[str, int] = field(default_factory=dict)
    """Bytes read or written on streams that ran over a circuit relay."""
    relayed_streams_refused: int = 0
    """Streams of direct_only_protocols refused because the only path was a relay."""


class Host(Protocol):
    """A running swarm member. Obtain one with p2p.host.open_host or p2p.fake.FakeNetwork.open_host."""

    peer_id: str

    def listen_addrs(self) -> list[str]:
        """Full multiaddrs including /p2p/<peer id>, ready to hand to others."""

    async def connect(self, addr: str) -> str:
        """Dial a /.../p2p/<id> multiaddr (bounded by dial_timeout_s); returns the peer id.

        PeerUnreachable when the dial fails or times out; ValueError for a malformed address.
        """

    async def disconnect(self, peer_id: str) -> None:
        """Close the connection; its streams end with StreamClosed and unread data is lost."""

    def connected_peers(self) -> list[str]: ...

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None: ...

    def set_offence_handler(self, handler: OffenceHandler | None) -> None:
        """Who hears of misbehaviour the host caught itself (see OffenceHandler)."""

    async def block_peer(self, peer_id: str, duration_s: float) -> None:
        """Disconnect ``peer_id`` and refuse its connections, streams and gossip for ``duration_s``."""

    async def open_stream(self, peer_id: str, protocol: str | Sequence[str]) -> Stream:
        """Open a stream (bounded by stream_open_timeout_s); PeerUnreachable on failure.

        ``protocol`` may be several, in order of preference: the stream runs the first the peer serves, and its
        ``protocol`` says which. A peer that serves none fails the open; the connection stays.
        """

    def subscribe(self, topic: str, validator: GossipValidator | None = None) -> trio.MemoryReceiveChannel[GossipMessage]:
        """Subscribe once per topic; messages from others that pass the validator arrive on the channel.

        The channel holds subscription_buffer messages; more are dropped and counted in
        statistics().gossip_dropped_queue_full. Our own publishes are not echoed back.
        """

    async def publish(self, topic: str, data: bytes) -> None:
        """Best-effort broadcast. Our own validator for the topic applies (a rejected message vanishes)."""

    async def wait_for_topic_peer(self, topic: str, peer_id: str) -> None:
        """Return once a publish on ``topic`` from this host reaches ``peer_id`` directly.

        GossipSub sends nothing to peers it has not yet learned are subscribed (or, when we are
        subscribed ourselves, that are not in our mesh), so a publish right after connect is lost.
        Waits without bound: callers wrap it in trio.fail_after.
        """

    def discovered(self) -> trio.MemoryReceiveChannel[str]:
        """Multiaddrs of peers found by mDNS (empty when mDNS is off); the node decides whom to dial."""

    def disconnections(self) -> trio.MemoryReceiveChannel[str]:
        """Peer ids whose last connection to this host closed, as it closes. A killed process's sockets
        close at once, long before its heartbeats are missed; the peer may still be reachable through
        others (their gossip of its heartbeats says so). One reader; a full channel drops the newest."""

    def statistics(self) -> HostStatistics: ...

    def reachability(self) -> Reachability:
        """What dial-backs have shown so far (status "unknown" until enough peers answered)."""

    def is_direct(self, peer_id: str) -> bool:
        """True when some connection to the peer goes straight to it, not through a relay."""
