"""Port mapping on the home router over NAT-PMP (RFC 6886), kept alive while the node runs.

A node behind a router that offers NAT-PMP asks it to forward its listen port, renews the mapping
before half its lifetime has passed, asks again at once if the router was restarted (its epoch
went back), and deletes the mapping when the node stops. Whether the mapping made the node
reachable is not taken on the router's word: the dial-back check (p2p.autonat) is asked about
the mapped port too, and only peers' successful dial-backs make the node public.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TypeVar

import trio

from protocol import natpmp
from protocol.errors import DecodeError

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
                   tries: int = TRIES) -> T:
    """Send payload to gateway:port on the RFC's retry schedule; return the first answer parse accepts.

    The socket is connected, so the kernel drops datagrams from any other address. A datagram that
    does not parse as the answer we wait for is ignored (logged), a refusal (NatPmpRefused) is
    raised, and silence or an ICMP port-unreachable raises NoAnswer.
    """
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            await sock.connect((gateway, port))
        except OSError as exc:
            raise NoAnswer(f"cannot reach {gateway}:{port} ({exc.strerror or exc})") from None
        wait_s = natpmp.RETRY_FIRST_S
        for _ in range(tries):
            try:
                await sock.send(payload)
            except OSError as exc:
                raise NoAnswer(f"cannot send to {gateway}:{port} ({exc.strerror or exc})") from None
            with trio.move_on_after(wait_s):
                while True:
                    try:
                        data = await sock.recv(64)
                    except ConnectionRefusedError:
                        raise NoAnswer(f"{gateway} answers no NAT-PMP on UDP port {port}") from None
                    try:
                        return parse(data)
                    except DecodeError as exc:
                        log.debug("ignored a datagram from %s:%d: %s", gateway, port, exc)
            wait_s *= 2
    total_s = natpmp.RETRY_FIRST_S * (2 ** tries - 1)
    raise NoAnswer(f"no NAT-PMP answer from {gateway} within {total_s:g} s")


@dataclass
class MappingState:
    status: str = "off"
    """off, trying, mapped or unavailable."""
    reason: str = "port_mapping is off"
    gateway: str = ""
    external_address: str = ""
    external_port: int = 0
    internal_port: int = 0
    lifetime_s: int = 0

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.line()}

    def line(self) -> str:
        if self.status == "mapped":
            return (f"NAT-PMP on {self.gateway}: {self.external_address}:{self.external_port} -> "
                    f"port {self.internal_port} (renewed every {self.lifetime_s // 2} s)")
        return f"{self.status}: {self.reason}"


class PortMapper:
    """Holds one TCP mapping for internal_port on the gateway; run() until cancelled."""

    def __init__(self, internal_port: int, *, gateway: str | None = None, port: int = natpmp.PORT,
                 lifetime_s: int = LIFETIME_S, check_s: float = CHECK_S,
                 on_change: Callable[[MappingState], None] | None = None):
        self.internal_port = internal_port
        self.gateway = gateway
        self.port = port
        self.lifetime_s = lifetime_s
        self.check_s = check_s
        self.on_change = on_change or (lambda state: None)
        self.state = MappingState(status="trying", reason="asking the router", internal_port=internal_port)
        self._epoch: tuple[int, float] | None = None
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
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await self._delete()

    async def _step(self) -> float:
        """Check the router's address and epoch; map when there is no mapping, it is due for renewal,
        or the router forgot it (restarted) or moved; return how long to wait before the next step."""
        gateway = self.gateway or default_gateway()
        if gateway is None:
            self._set(status="unavailable", reason="no IPv4 default gateway to ask")
            return RETRY_UNAVAILABLE_S
        try:
            address = await exchange(gateway, natpmp.external_address_request(), natpmp.parse_external_address,
                                     port=self.port)
            now = trio.current_time()
            restarted = self._epoch is not None and natpmp.epoch_went_back(*self._epoch, address.epoch_s, now)
            self._epoch = (address.epoch_s, now)
            if restarted:
                log.info("the router at %s lost its mappings (its epoch went back); mapping again", gateway)
            if restarted or self.state.status != "mapped" or now >= self._renew_at \
                    or address.address != self.state.external_address:
                # Ask for the port we already hold (or our own): routers keep a mapping's port when they can.
                wanted = self.state.external_port or self.internal_port
                request = natpmp.map_request(self.internal_port, external_port=wanted, lifetime_s=self.lifetime_s)
                mapping = await exchange(gateway, request,
                                         lambda d: natpmp.parse_mapping(d, internal_port=self.internal_port),
                                         port=self.port)
                if mapping.lifetime_s == 0:
                    raise natpmp.NatPmpRefused(4)
                self._renew_at = now + mapping.lifetime_s / 2
                self._set(status="mapped", reason="", gateway=gateway, external_address=address.address,
                          external_port=mapping.external_port, lifetime_s=mapping.lifetime_s)
        except (NoAnswer, natpmp.NatPmpRefused) as exc:
            self._set(status="unavailable", reason=f"{gateway}: {exc}", gateway=gateway, external_port=0,
                      external_address="", lifetime_s=0)
            return RETRY_UNAVAILABLE_S
        return max(0.1, min(self.check_s, self._renew_at - trio.current_time()))

    async def _delete(self) -> None:
        if self.state.status != "mapped":
            return
        try:
            await exchange(self.state.gateway, natpmp.map_request(self.internal_port, lifetime_s=0),
                           lambda d: natpmp.parse_mapping(d, internal_port=self.internal_port),
                           port=self.port, tries=2)
            log.info("port mapping on %s deleted", self.state.gateway)
        except (NoAnswer, natpmp.NatPmpRefused) as exc:
            log.info("port mapping on %s not deleted (%s); it lapses after its lifetime", self.state.gateway, exc)
