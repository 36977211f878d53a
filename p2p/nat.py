"""NAT traversal for a libp2p host: reachability checks, circuit relay v2 (both sides) and DCUtR hole punching.

Public nodes serve as limited relays; private nodes reserve slots on a few of them and announce
the relayed addresses. py-libp2p's DCUtR service then tries to punch a direct connection to every
peer reached through a relay. A relayed connection is for gossip and small control streams: the
host refuses to run bulk protocols over one (HostConfig.direct_only_protocols).
"""

from __future__ import annotations

import logging
from typing import Any

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL, STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from p2p import autonat
from p2p.api import HostConfig, Reachability
from p2p.notifee import ConnectionEvents
from p2p.portmap import PortMapper
from protocol import natpmp

log = logging.getLogger("shoal.nat")

MAX_SERVERS = 3
"""Peers asked for a dial-back in one check."""
RECHECK_S = 120.0
RETRY_S = 3.0
"""While the verdict is unknown (too few peers yet), how soon to ask again."""
MAX_RELAYS = 2
RELAY_LIMITS = RelayLimits(duration=3600, data=64 * 1024 * 1024, max_circuit_conns=32, max_reservations=32)
"""Per circuit: an hour and 64 MiB, enough for gossip and control streams for a long while, never for shards."""


def is_relayed_conn(conn: Any) -> bool:
    try:
        return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())
    except Exception:  # a connection being torn down
        return False


def peer_conns(raw_host: Any, peer_id: ID) -> list[Any]:
    conns = raw_host.get_network().connections.get(peer_id, [])
    return conns if isinstance(conns, list) else [conns]


def is_relayed_stream(raw_stream: Any) -> bool:
    try:
        return any("/p2p-circuit" in str(a) for a in raw_stream.muxed_conn.get_transport_addresses())
    except Exception:
        return False


class NatService:
    """Runs beside a libp2p host; create with run_nat(raw_host, config) inside a nursery."""

    def __init__(self, raw_host: Any, config: HostConfig):
        self._host = raw_host
        self._config = config
        self.verdict = autonat.Verdict()
        self.status, self.reason = "unknown", "no peer has answered a dial-back request yet"
        self.relays: dict[str, str] = {}  # relay peer id -> our relayed address through it
        self.relaying = False
        self.peer_connected = trio.Event()
        self.protocol = CircuitV2Protocol(raw_host, limits=RELAY_LIMITS, allow_hop=config.relay_service)
        self.transport = CircuitV2Transport(raw_host, self.protocol,
                                            RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT, limits=RELAY_LIMITS))
        self.dcutr = DCUtRProtocol(raw_host)
        self.mapper: PortMapper | None = None
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None

    def reachability(self) -> Reachability:
        me = str(self._host.get_id())
        return Reachability(
            status=self.status, reason=self.reason,
            observed_ips=tuple(self.verdict.observed_ips()),
            public_addrs=tuple(f"/ip4/{ip}/tcp/{port}/p2p/{me}" for ip, port in self.verdict.public_endpoints()),
            relay_addrs=tuple(self.relays.values()), relaying=self.relaying,
            dial_backs_ok=sum(1 for a in self.verdict.answers.values() if a.reachable_ports),
            dial_backs_failed=sum(1 for a in self.verdict.answers.values() if not a.reachable_ports),
            port_mapping=self.mapper.state.to_dict() if self.mapper is not None else {})

    def is_direct(self, peer_id: str) -> bool:
        return any(not is_relayed_conn(c) for c in peer_conns(self._host, ID.from_base58(peer_id)))

    async def dial_relayed(self, addr: str) -> None:
        """Connect through /.../p2p/<relay>/p2p-circuit/p2p/<peer>; the relay must be reachable."""
        maddr = multiaddr.Multiaddr(addr)
        relay_part = addr.split("/p2p-circuit", 1)[0]
        relay_id = ID.from_base58(relay_part.rsplit("/p2p/", 1)[1])
        if not peer_conns(self._host, relay_id):
            from libp2p.peer.peerinfo import info_from_p2p_addr
            await self._host.connect(info_from_p2p_addr(multiaddr.Multiaddr(relay_part)))
        await self.transport.dial(maddr)

    # -- running ---------------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self._host.set_stream_handler(TProtocol(autonat.PROTOCOL), self._guard(self._serve_autonat))
        self._host.set_stream_handler(STOP_PROTOCOL_ID, self._guard(self.protocol._handle_stop_stream))
        self._host.get_network().register_notifee(ConnectionEvents(on_connected=lambda conn: self.peer_connected.set()))
        async with background_trio_service(self.protocol), background_trio_service(self.dcutr), \
                trio.open_nursery() as nursery:
            self._nursery = nursery
            self._start_port_mapping(nursery)
            nursery.start_soon(self._check_forever)
            task_status.started(self)

    def _guard(self, handler):
        async def serve(raw_stream: Any) -> None:
            # An exception escaping a libp2p stream handler would take down the whole host.
            try:
                await handler(raw_stream)
            except Exception:
                log.debug("NAT handler failed", exc_info=True)
                with trio.move_on_after(1.0, shield=True):
                    try:
                        await raw_stream.reset()
                    except Exception:
                        pass
        return serve

    async def _serve_autonat(self, raw_stream: Any) -> None:
        await autonat.serve_dial_back(self._host, raw_stream)

    def _start_port_mapping(self, nursery: trio.Nursery) -> None:
        ports = self._listen_ports()
        if not self._config.port_mapping or not ports:
            return
        gateway, _, port = self._config.port_mapping_gateway.partition(":")
        self.mapper = PortMapper(ports[0], gateway=gateway or None, port=int(port) if port else natpmp.PORT,
                                 on_change=lambda state: self._wake.set())
        nursery.start_soon(self.mapper.run)

    def _listen_ports(self) -> list[int]:
        """Ports peers are asked to dial us back on: those we listen on, and the one the router mapped."""
        ports = {ep[1] for a in self._host.get_transport_addrs() if (ep := autonat.tcp_endpoint(a))}
        if self.mapper is not None and self.mapper.state.status == "mapped":
            ports.add(self.mapper.state.external_port)
        return sorted(ports)

    def _direct_peers(self) -> list[ID]:
        me = self._host.get_id()
        return [pid for pid in self._host.get_connected_peers()
                if pid != me and any(not is_relayed_conn(c) for c in peer_conns(self._host, pid))]

    async def _check_forever(self) -> None:
        while True:
            # Reset before the check, so a port mapping that changes while it runs still wakes the wait below.
            self._wake = trio.Event()
            await self.check_once()
            if self.status == "private":
                await self._keep_relays()
            delay_s = RETRY_S if self.status == "unknown" or (self.status == "private" and not self.relays) \
                else RECHECK_S
            self.peer_connected = trio.Event()
            with trio.move_on_after(delay_s):
                # A new peer is a new witness while we know nothing yet; a new port mapping is worth
                # checking at once; otherwise wait the period out.
                if self.status == "unknown":
                    await self.peer_connected.wait()
                    await trio.sleep(delay_s)
                await self._wake.wait()

    async def check_once(self) -> None:
        servers = self._direct_peers()[:MAX_SERVERS]
        ports = self._listen_ports()
        if not servers or not ports:
            return
        answers: list[autonat.Answer] = []

        async def one(server: ID) -> None:
            answer = await autonat.ask(self._host, server, ports)
            if answer is not None:
                answers.append(answer)

        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(one, server)
        for answer in answers:
            self.verdict.add(answer)
        status, reason = self.verdict.status()
        if status != self.status:
            log.info("reachability: %s (%s)", status, reason)
        self.status, self.reason = status, reason
        self._set_relaying(status == "public" and self._config.relay_service)

    def _set_relaying(self, on: bool) -> None:
        if on == self.relaying:
            return
        if on:
            self._host.set_stream_handler(HOP_PROTOCOL, self._guard(self.protocol._handle_hop_stream))
            log.info("serving as a circuit relay for private peers (limits: %d MiB and %d s per circuit)",
                     RELAY_LIMITS.data >> 20, RELAY_LIMITS.duration)
        else:
            self._host.remove_stream_handler(HOP_PROTOCOL)
        self.relaying = on

    async def _keep_relays(self) -> None:
        """Hold reservations on up to MAX_RELAYS directly connected peers that serve as relays."""
        connected = {str(p) for p in self._host.get_connected_peers()}
        for relay_id in [r for r in self.relays if r not in connected]:
            log.info("relay %s is gone; its relayed address is withdrawn", relay_id)
            del self.relays[relay_id]
        me = str(self._host.get_id())
        for pid in self._direct_peers():
            if len(self.relays) >= MAX_RELAYS:
                return
            if str(pid) in self.relays:
                continue
            try:
                with trio.fail_after(self._config.stream_open_timeout_s):
                    stream = await self._host.new_stream(pid, [HOP_PROTOCOL])
                    ok = await self.transport.reserve(stream, pid, self._nursery)
            except Exception as exc:  # not a relay (public peers only serve), or it refused us
                log.debug("no reservation on %s: %r", pid, exc)
                continue
            if not ok:
                continue
            remote = next((c for c in peer_conns(self._host, pid) if not is_relayed_conn(c)), None)
            endpoint = None
            if remote is not None:
                endpoint = next((autonat.tcp_endpoint(a) for a in remote.get_transport_addresses()
                                 if autonat.tcp_endpoint(a)), None)
            if endpoint is None:
                continue
            addr = f"/ip4/{endpoint[0]}/tcp/{endpoint[1]}/p2p/{pid}/p2p-circuit/p2p/{me}"
            self.relays[str(pid)] = addr
            log.info("reserved a relay slot on %s; reachable at %s", pid, addr)
