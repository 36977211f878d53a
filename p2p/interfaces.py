"""This host's IPv4 interface addresses, and the listen addresses a peer on the same link can dial."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Any

_SIOCGIFADDR = 0x8915


def interface_ipv4_addresses() -> list[str]:
    """Addresses of the host's up interfaces (Linux ioctl), loopback last; empty when unknown."""
    found: list[str] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            address = socket.inet_ntoa(packed[20:24])
            if address not in found:
                found.append(address)
    return sorted(found, key=lambda a: (ipaddress.ip_address(a).is_loopback, a))


def is_unspecified(addr: str) -> bool:
    """/ip4/0.0.0.0/... or /ip6/::/...: a listen address; dialled, it reaches the dialer itself."""
    return addr.startswith(("/ip4/0.0.0.0/", "/ip6/::/"))


def link_dialable(addrs: list[str], interfaces: list[str] | None = None) -> list[str]:
    """What a peer on the same link (mDNS) can dial: /ip4/0.0.0.0/ becomes each non-loopback interface's
    address (loopback only when it is the only one), /ip6/::/ is dropped, the others stay as they are."""
    if interfaces is None:
        interfaces = interface_ipv4_addresses()
    outside = [ip for ip in interfaces if not ipaddress.ip_address(ip).is_loopback] or interfaces
    out: list[str] = []
    for addr in addrs:
        if addr.startswith("/ip4/0.0.0.0/"):
            out.extend(addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in outside)
        elif not is_unspecified(addr):
            out.append(addr)
    return out


def advertise_dialable_over_mdns(broadcaster: Any) -> None:
    """py-libp2p's mDNS puts the transport addresses in its TXT records as they are, and its listener
    reads only those records (not the A records): a node listening on /ip4/0.0.0.0/tcp/4001 told its
    peers to dial 0.0.0.0, which reaches the dialer itself, and Noise failed there on its own key (three
    containers on one bridge found each other and never connected). Advertise the interfaces instead."""
    resolve = broadcaster._resolve_host_addrs
    broadcaster._resolve_host_addrs = lambda: link_dialable(resolve())
