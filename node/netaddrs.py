"""Announced addresses (0.0.0.0 becomes each interface's address) and checks of the addresses a user typed."""

from __future__ import annotations

import ipaddress

from p2p.interfaces import interface_ipv4_addresses


def expand_unspecified(addrs: list[str]) -> list[str]:
    """Replace /ip4/0.0.0.0/ in multiaddrs by each interface address; keep the others as they are."""
    out: list[str] = []
    for addr in addrs:
        if "/ip4/0.0.0.0/" in addr:
            out.extend(addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/") for ip in interface_ipv4_addresses())
        elif "/ip6/::/" not in addr:
            out.append(addr)
    return out


# -- checking addresses a user typed (config, flags): one reason per problem, None when fine ----------

def _parse(addr: str):
    import multiaddr  # small; libp2p itself is imported only once the node starts

    try:
        return multiaddr.Multiaddr(addr), None
    except Exception as exc:  # py-multiaddr raises several unrelated kinds for bad input
        reason = str(exc).split(" (string:")[0]
        return None, f"not a valid multiaddr ({reason}); write it like /ip4/1.2.3.4/tcp/4001"


def _protocols(maddr) -> list[str]:
    return [p.name for p in maddr.protocols()]


def multiaddr_problem(addr: str) -> str | None:
    return _parse(addr)[1]


def listen_problem(addr: str) -> str | None:
    """Shoal serves TCP (Noise + Yamux) only: /ip4|ip6/<address>/tcp/<port>, nothing after it."""
    maddr, problem = _parse(addr)
    if problem:
        return problem
    names = _protocols(maddr)
    if len(names) != 2 or names[0] not in ("ip4", "ip6") or names[1] != "tcp":
        return ("Shoal listens on TCP only, as /ip4/<address>/tcp/<port> or /ip6/<address>/tcp/<port> "
                "(QUIC, websockets and /p2p/ suffixes are not served)")
    return None


def dial_problem(addr: str) -> str | None:
    """A peer address to dial: a transport address ending in /p2p/<a valid peer id>."""
    maddr, problem = _parse(addr)
    if problem:
        return problem
    names = _protocols(maddr)
    # /memory/<n> is p2p.fake's in-process network, which tests run whole nodes on.
    if names[-1:] != ["p2p"] or not ("tcp" in names or names[0] == "memory"):
        return "needs a TCP address and its /p2p/<peer id> suffix, e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3KooW... (see `shoal id` on that node)"
    if not is_peer_id(maddr.value_for_protocol("p2p")):
        return "its /p2p/ part is not a peer id (see `shoal id` on that node)"
    return None


def is_peer_id(text: str) -> bool:
    """A base58 multihash of an Ed25519 or secp256k1 key, as libp2p prints peer ids."""
    import base58

    if not text.startswith(("12D3KooW", "16Uiu2", "Qm")):
        return False
    try:
        raw = base58.b58decode(text)
    except ValueError:
        return False
    # multihash: <code> <length> <digest>; identity (0x00) for inline keys, sha2-256 (0x12) otherwise
    return len(raw) >= 2 and raw[0] in (0x00, 0x12) and raw[1] == len(raw) - 2


def ipv4_port_problem(text: str) -> str | None:
    """Why text is not "IPv4" or "IPv4:PORT"; None when it is."""
    host, sep, port = text.partition(":")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return f"{host!r} is not an IPv4 address"
    if sep and not (port.isdigit() and 0 < int(port) < 65536):
        return f"{port!r} is not a UDP port (1-65535)"
    return None
