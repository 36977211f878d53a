"""Port mapping on the home router, over NAT-PMP (RFC 6886) or UPnP IGD, kept alive while the node runs.

A node behind a router asks it to forward its listen port: NAT-PMP first, then UPnP IGD, each
asked of the gateway alone (nothing is multicast). It renews the mapping before half its
lifetime has passed, maps again at once if the router forgot it (NAT-PMP: its epoch went back;
UPnP: the mapping is no longer listed), and deletes the mapping when the node stops. Whether the
mapping made the node reachable is not taken on the router's word: the dial-back check
(p2p.autonat) is asked about the mapped port too, and only peers' successful dial-backs make the
node public.
"""

from __future__ import annotations

import logging
import socket
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TypeVar

import trio

from protocol import natpmp, upnp
from protocol.errors import DecodeError, RemoteProtocolError

log = logging.getLogger("shoal.nat")

T = TypeVar("T")

TRIES = 4
"""250 ms, 0.5, 1 and 2 s: a router that offers NAT-PMP answers in milliseconds."""
LIFETIME_S = 3600
CHECK_S = 60.0
"""How often to ask the router's address and epoch: a restarted router has forgotten our mapping."""
RETRY_UNAVAILABLE_S = 300.0
"""How soon to ask again after no answer or a refusal (the router may be rebooting)."""
RTF_UP, RTF_GATEWAY = 0x1, 0x2
HTTP_TIMEOUT_S = 5.0
MAX_DATAGRAM_BYTES = 2048
"""NAT-PMP answers are 16 bytes at most; an SSDP answer is a few hundred."""
SSDP_WAIT_S = upnp.SEARCH_MX_S + 0.5
"""Routers delay each search answer by up to MX seconds, even to a unicast search."""
DESCRIPTION = "shoal"


class NoAnswer(Exception):
    """The gateway did not answer, or said nothing listens on its NAT-PMP port."""


def default_gateway(route_file: Path = Path("/proc/net/route")) -> str | None:
    """The IPv4 default route's gateway, from the kernel's routing table; None without one."""
    try:
        lines = route_file.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 4 or fields[1] != "00000000":
            continue
        try:
            flags, gateway = int(fields[3], 16), int(fields[2], 16)
        except ValueError:
            continue
        if flags & RTF_UP and flags & RTF_GATEWAY and gateway:
            return socket.inet_ntoa(gateway.to_bytes(4, "little"))
    return None


async def exchange(gateway: str, payload: bytes, parse: Callable[[bytes], T], *, port: int = natpmp.PORT,
                   tries: int = TRIES, first_wait_s: float = natpmp.RETRY_FIRST_S, what: str = "NAT-PMP",
                   any_source_port: bool = False) -> T:
    """Send payload to gateway:port on the RFC's retry schedule; return the first answer parse accepts.

    Only the gateway's datagrams are read: the socket is connected to gateway:port, so the kernel
    drops anyone else's and reports an ICMP port-unreachable; with any_source_port (SSDP answers
    come from another port than 1900) it is not, and datagrams from other addresses are skipped. A
    datagram that does not parse as the answer we wait for is ignored (logged), a refusal is
    raised, and silence or a port-unreachable raises NoAnswer.
    """
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            if any_source_port:
                await sock.bind(("0.0.0.0", 0))
            else:
                await sock.connect((gateway, port))
        except OSError as exc:
            raise NoAnswer(f"cannot reach {gateway}:{port} ({exc.strerror or exc})") from None
        wait_s = first_wait_s
        for _ in range(tries):
            try:
                await sock.sendto(payload, (gateway, port))
            except OSError as exc:
                raise NoAnswer(f"cannot send to {gateway}:{port} ({exc.strerror or exc})") from None
            with trio.move_on_after(wait_s):
                while True:
                    try:
                        data, source = await sock.recvfrom(MAX_DATAGRAM_BYTES)
                    except ConnectionRefusedError:
                        raise NoAnswer(f"{gateway} answers no {what} on UDP port {port}") from None
                    if source[0] != gateway:
                        continue
                    try:
                        return parse(data)
                    except DecodeError as exc:
                        log.debug("ignored a datagram from %s:%d: %s", *source, exc)
            wait_s *= 2
    total_s = first_wait_s * (2 ** tries - 1)
    raise NoAnswer(f"no {what} answer from {gateway} within {total_s:g} s")


class NatPmpRouter:
    """A gateway that speaks NAT-PMP; the epoch in its answers tells when it forgot its mappings."""

    name = "NAT-PMP"

    def __init__(self, gateway: str, port: int = natpmp.PORT):
        self.gateway, self.port = gateway, port
        self._epoch: tuple[int, float] | None = None

    async def address(self) -> tuple[str, bool]:
        """(external address, whether the router lost its mappings since we last asked)."""
        answer = await exchange(self.gateway, natpmp.external_address_request(), natpmp.parse_external_address,
                                port=self.port)
        now = trio.current_time()
        forgot = self._epoch is not None and natpmp.epoch_went_back(*self._epoch, answer.epoch_s, now)
        self._epoch = (answer.epoch_s, now)
        return answer.address, forgot

    async def map(self, internal: int, wanted: int, lifetime_s: int) -> tuple[int, int]:
        request = natpmp.map_request(internal, external_port=wanted, lifetime_s=lifetime_s)
        mapping = await exchange(self.gateway, request, lambda d: natpmp.parse_mapping(d, internal_port=internal),
                                 port=self.port)
        if mapping.lifetime_s == 0:
            raise natpmp.NatPmpRefused(4)
        return mapping.external_port, mapping.lifetime_s

    async def delete(self, internal: int, external: int) -> None:
        await exchange(self.gateway, natpmp.map_request(internal, lifetime_s=0),
                       lambda d: natpmp.parse_mapping(d, internal_port=internal), port=self.port, tries=2)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect would lead away from the gateway: it stays an error status


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects)
"""Straight to the router: no proxy from the environment, no redirects."""


def _http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP request to the router (in a worker thread); (status, at most MAX_DOCUMENT_BYTES + 1 bytes)."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with _OPENER.open(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status, response.read(upnp.MAX_DOCUMENT_BYTES + 1)
    except urllib.error.HTTPError as exc:  # a SOAP fault comes as HTTP 500 with its body
        return exc.code, exc.read(upnp.MAX_DOCUMENT_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise NoAnswer(f"UPnP request to {url} failed ({exc})") from None


def alternate_ports(internal: int, count: int = 3) -> list[int]:
    """Ports to ask for when ours is taken: spread over the dynamic range, the same on every try."""
    return [49152 + (internal + 4099 * k) % 16384 for k in range(1, count + 1)]


class UpnpRouter:
    """A gateway that speaks UPnP IGD, found by a unicast M-SEARCH to its port 1900."""

    name = "UPnP IGD"

    def __init__(self, gateway: str, ssdp_port: int = upnp.SSDP_PORT):
        self.gateway, self.ssdp_port = gateway, ssdp_port
        self.service: upnp.Service | None = None
        self.local_address = ""

    async def _call(self, action: str, **args: str | int) -> dict[str, str]:
        if self.service is None:
            location = await exchange(self.gateway, upnp.search_request(self.gateway),
                                      lambda d: upnp.parse_search_response(d, self.gateway), port=self.ssdp_port,
                                      tries=2, first_wait_s=SSDP_WAIT_S, what="UPnP (SSDP)", any_source_port=True)
            status, description = await trio.to_thread.run_sync(_http, location)
            if status != 200:
                raise NoAnswer(f"the router's UPnP description at {location} answered HTTP {status}")
            self.service = upnp.find_connection_service(description, location, self.gateway)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the address the router sees us at
                probe.connect((self.gateway, self.ssdp_port))
                self.local_address = probe.getsockname()[0]
        headers, body = upnp.soap_request(self.service, action, args)
        status, reply = await trio.to_thread.run_sync(_http, self.service.control_url, body, headers)
        return upnp.parse_soap_response(status, reply, action)

    async def address(self) -> tuple[str, bool]:
        return upnp.external_address(await self._call("GetExternalIPAddress")), False

    async def still_mapped(self, internal: int, external: int) -> bool:
        try:
            entry = await self._call("GetSpecificPortMappingEntry", NewRemoteHost="", NewExternalPort=external,
                                     NewProtocol="TCP")
        except upnp.UpnpFault:
            return False
        return entry.get("NewInternalClient") == self.local_address and entry.get("NewInternalPort") == str(internal)

    async def map(self, internal: int, wanted: int, lifetime_s: int) -> tuple[int, int]:
        """Unlike NAT-PMP, UPnP does not pick another port when ours is taken (another host in the home
        may run a node on it too): on error 718 we try a few others ourselves."""
        for external in [wanted, *alternate_ports(internal)]:
            args = dict(NewRemoteHost="", NewExternalPort=external, NewProtocol="TCP", NewInternalPort=internal,
                        NewInternalClient=self.local_address, NewEnabled=1, NewPortMappingDescription=DESCRIPTION)
            try:
                await self._call("AddPortMapping", **args, NewLeaseDuration=lifetime_s)
                return external, lifetime_s
            except upnp.UpnpFault as exc:
                if exc.code == 725:
                    # IGD:1 routers that keep only permanent mappings: one is deleted when the node stops.
                    await self._call("AddPortMapping", **args, NewLeaseDuration=0)
                    return external, 0
                if exc.code != 718:
                    raise
                log.info("UPnP: external port %d is mapped to another host; trying another", external)
        raise upnp.UpnpFault(718, "")

    async def delete(self, internal: int, external: int) -> None:
        await self._call("DeletePortMapping", NewRemoteHost="", NewExternalPort=external, NewProtocol="TCP")


REFUSALS = (NoAnswer, RemoteProtocolError)
"""What a router's failure to map looks like: silence, or an answer refused or malformed."""


@dataclass
class MappingState:
    status: str = "off"
    """off, trying, mapped or unavailable."""
    reason: str = "port_mapping is off"
    protocol: str = ""
    """NAT-PMP or UPnP IGD, once one answered."""
    gateway: str = ""
    external_address: str = ""
    external_port: int = 0
    internal_port: int = 0
    lifetime_s: int = 0
    """0: a permanent mapping (some UPnP routers keep no other kind)."""

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.line()}

    def line(self) -> str:
        if self.status == "mapped":
            renewal = f"renewed every {self.lifetime_s // 2} s" if self.lifetime_s else "permanent until we stop"
            return (f"{self.protocol} on {self.gateway}: {self.external_address}:{self.external_port} -> "
                    f"port {self.internal_port} ({renewal})")
        return f"{self.status}: {self.reason}"


class PortMapper:
    """Holds one TCP mapping for internal_port on the gateway; run() until cancelled."""

    def __init__(self, internal_port: int, *, gateway: str | None = None, port: int = natpmp.PORT,
                 ssdp_port: int = upnp.SSDP_PORT, lifetime_s: int = LIFETIME_S, check_s: float = CHECK_S,
                 on_change: Callable[[MappingState], None] | None = None):
        self.internal_port = internal_port
        self.gateway = gateway
        self.port, self.ssdp_port = port, ssdp_port
        self.lifetime_s = lifetime_s
        self.check_s = check_s
        self.on_change = on_change or (lambda state: None)
        self.state = MappingState(status="trying", reason="asking the router", internal_port=internal_port)
        self.router: NatPmpRouter | UpnpRouter | None = None
        self._renew_at = 0.0

    def _set(self, **changes) -> None:
        before = self.state
        self.state = MappingState(**{**asdict(before), **changes})
        if (before.status, before.external_address, before.external_port) != \
                (self.state.status, self.state.external_address, self.state.external_port):
            log.info("port mapping: %s", self.state.line())
            self.on_change(self.state)

    async def run(self) -> None:
        try:
            while True:
                await trio.sleep(await self._step())
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(HTTP_TIMEOUT_S):
                await self._delete()

    async def _find_router(self, gateway: str) -> tuple[NatPmpRouter | UpnpRouter, str]:
        """The first protocol the gateway answers, with its external address."""
        failures = []
        for router in (NatPmpRouter(gateway, self.port), UpnpRouter(gateway, self.ssdp_port)):
            try:
                address, _ = await router.address()
                return router, address
            except REFUSALS as exc:
                failures.append(f"{router.name}: {exc}")
        raise NoAnswer("; ".join(failures))

    async def _step(self) -> float:
        """Check the router's address; map when there is no mapping, it is due for renewal, or the router
        forgot it or moved; return how long to wait before the next step."""
        gateway = self.gateway or default_gateway()
        if gateway is None:
            self._set(status="unavailable", reason="no IPv4 default gateway to ask")
            return RETRY_UNAVAILABLE_S
        try:
            if self.router is None or self.router.gateway != gateway:
                self.router, address = await self._find_router(gateway)
                forgot = False
            else:
                address, forgot = await self.router.address()
            router, mapped = self.router, self.state.status == "mapped"
            if mapped and isinstance(router, UpnpRouter):
                forgot = not await router.still_mapped(self.internal_port, self.state.external_port)
            if forgot:
                log.info("the router at %s lost our mapping; mapping again", gateway)
            now = trio.current_time()
            if forgot or not mapped or (self.state.lifetime_s and now >= self._renew_at) \
                    or address != self.state.external_address:
                # Ask for the port we already hold (or our own): routers keep a mapping's port when they can.
                wanted = self.state.external_port or self.internal_port
                external, lifetime = await router.map(self.internal_port, wanted, self.lifetime_s)
                self._renew_at = now + lifetime / 2
                self._set(status="mapped", reason="", protocol=router.name, gateway=gateway, external_address=address,
                          external_port=external, lifetime_s=lifetime)
        except REFUSALS as exc:
            self.router = None
            self._set(status="unavailable", reason=f"{gateway}: {exc}", gateway=gateway, external_port=0,
                      external_address="", lifetime_s=0)
            return RETRY_UNAVAILABLE_S
        if not self.state.lifetime_s:  # permanent: only checks
            return self.check_s
        return max(0.1, min(self.check_s, self._renew_at - trio.current_time()))

    async def _delete(self) -> None:
        if self.state.status != "mapped" or self.router is None:
            return
        try:
            await self.router.delete(self.internal_port, self.state.external_port)
            log.info("port mapping on %s deleted", self.state.gateway)
        except REFUSALS as exc:
            log.info("port mapping on %s not deleted (%s); it lapses after its lifetime", self.state.gateway, exc)
