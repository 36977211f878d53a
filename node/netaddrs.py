"""This host's IPv4 interface addresses, to announce something dialable when listening on 0.0.0.0."""

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


def expand_unspecified(addrs: list[str]) -> list[str]:
    """Replace /ip4/0.0.0.0/ in multiaddrs by each interface address; keep the others as they are."""
    out: list[str] = []
    for addr in addrs:
        if "/ip4/0.0.0.0/" in addr:
            out.extend(addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/") for ip in interface_ipv4_addresses())
        elif "/ip6/::/" not in addr:
            out.append(addr)
    return out
