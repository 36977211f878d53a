"""This host's IPv4 interface addresses, and the listen addresses a peer on the same link can dial."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

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
