"""NAT-PMP (RFC 6886) messages, sans-IO: ask a home router for its public address and a port mapping.

A client sends each request to its default gateway's UDP port 5351 and retries on the RFC's
schedule (250 ms, doubling); the router answers with a result code and, on success, the address
or the mapping it granted. The router may grant another external port or a shorter lifetime than
asked, so callers use what the answer says. A mapping is renewed before half its lifetime has
passed and deleted by asking for it again with a lifetime of 0.

Every answer is checked for its length, version, opcode and (for mappings) the internal port we
asked about, so a stray or forged datagram is refused with a DecodeError, never half-used.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from protocol.errors import DecodeError, RemoteProtocolError

PORT = 5351
VERSION = 0
OP_EXTERNAL_ADDRESS = 0
OP_MAP_UDP = 1
OP_MAP_TCP = 2
RESPONSE_BIT = 128
RETRY_FIRST_S = 0.25
"""RFC 6886 3.1: the first retry after 250 ms, each later one after twice the last wait."""

RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized or refused (port mapping is turned off on the router)",
    3: "network failure (the router has no public address yet)",
    4: "out of resources (the router has no mappings left)",
    5: "unsupported opcode",
}


class NatPmpRefused(RemoteProtocolError):
    """The router answered with a non-zero result code; the message gives the RFC's meaning."""

    def __init__(self, code: int):
        self.code = code
        super().__init__(f"the router refused: {RESULTS.get(code, f'result code {code}')}")


@dataclass(frozen=True, slots=True)
class ExternalAddress:
    epoch_s: int
    """Seconds since the router's mappings were last reset; going backwards means it forgot them."""
    address: str


@dataclass(frozen=True, slots=True)
class Mapping:
    epoch_s: int
    internal_port: int
    external_port: int
    lifetime_s: int
    """0 when the answer confirms a deletion."""


def external_address_request() -> bytes:
    return struct.pack("!BB", VERSION, OP_EXTERNAL_ADDRESS)


def map_request(internal_port: int, *, external_port: int = 0, lifetime_s: int = 7200, tcp: bool = True) -> bytes:
    """Ask for internal_port to be reachable from outside; lifetime 0 (with external port 0) deletes it."""
    if not 0 < internal_port < 65536 or not 0 <= external_port < 65536:
        raise ValueError(f"ports must be 1..65535 (internal {internal_port}, external {external_port})")
    if not 0 <= lifetime_s < 2**32:
        raise ValueError(f"lifetime must be 0..2^32-1 seconds, not {lifetime_s}")
    op = OP_MAP_TCP if tcp else OP_MAP_UDP
    return struct.pack("!BBHHHI", VERSION, op, 0, internal_port, external_port, lifetime_s)


def _header(data: bytes, op: int, size: int) -> int:
    """Check version, opcode and result; return the epoch."""
    if len(data) < 4:
        raise DecodeError(f"NAT-PMP answer of {len(data)} bytes, under its 4-byte header")
    version, got_op, result = struct.unpack_from("!BBH", data)
    if version != VERSION:
        raise DecodeError(f"NAT-PMP answer with version {version}, not {VERSION}")
    if got_op != RESPONSE_BIT + op:
        raise DecodeError(f"NAT-PMP datagram with opcode {got_op}, not the answer to opcode {op} "
                          f"({RESPONSE_BIT + op})")
    if result != 0:
        raise NatPmpRefused(result)
    if len(data) != size:
        raise DecodeError(f"NAT-PMP answer of {len(data)} bytes, not {size}")
    return struct.unpack_from("!I", data, 4)[0]


def parse_external_address(data: bytes) -> ExternalAddress:
    epoch = _header(data, OP_EXTERNAL_ADDRESS, 12)
    address = ipaddress.IPv4Address(data[8:12])
    if address.is_unspecified:
        # RFC 6886 3.2: 0.0.0.0 means the router has no public address (its uplink is down).
        raise NatPmpRefused(3)
    return ExternalAddress(epoch_s=epoch, address=str(address))


def parse_mapping(data: bytes, *, internal_port: int, tcp: bool = True) -> Mapping:
    epoch = _header(data, OP_MAP_TCP if tcp else OP_MAP_UDP, 16)
    internal, external, lifetime = struct.unpack_from("!HHI", data, 8)
    if internal != internal_port:
        raise DecodeError(f"NAT-PMP mapping answer for internal port {internal}, not {internal_port}")
    if lifetime and not 0 < external < 65536:
        raise DecodeError(f"NAT-PMP mapping answer with external port {external}")
    return Mapping(epoch_s=epoch, internal_port=internal, external_port=external, lifetime_s=lifetime)


def epoch_went_back(before: int, before_at_s: float, now: int, now_at_s: float) -> bool:
    """RFC 6886 3.6: the router lost its mappings if its epoch advanced less than 7/8 of our clock's
    elapsed time (less 2 s of slack); then every mapping must be asked for again."""
    elapsed = now_at_s - before_at_s
    return now + 2 < before + elapsed * 7 / 8
