"""Reachability from dial-backs on fresh connections: Shoal's own small AutoNAT over libp2p streams.

py-libp2p's AutoNAT server dials back with host.connect(), which returns at once because the
asker is already connected, so every node behind NAT would be told it is public. Here the server
opens a new TCP connection to the address it observed the asker at (that IP only, with the ports
the asker listens on, so no one can aim it at a third party) and runs Noise over it, which proves
the dial reached the asker and not just some open port; then it closes it without adding it to
the swarm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack
import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

log = logging.getLogger("shoal.nat")

PROTOCOL = "/shoal/autonat/1"
MAX_MESSAGE_BYTES = 4096
MAX_DIAL_BACKS = 4
DIAL_BACK_TIMEOUT_S = 4.0
ASK_TIMEOUT_S = DIAL_BACK_TIMEOUT_S * MAX_DIAL_BACKS + 4.0
MIN_CONFIRMATIONS = 2
"""Answers that must agree before a verdict (fewer when fewer peers could be asked)."""


class _QuietDialBacks(logging.Filter):
    """A dial-back stops after the Noise handshake, so the asker's swarm logs a muxer failure at
    ERROR for every check it receives; going on to a muxer would make it a second connection, which
    libp2p may trim by closing the first. The message says nothing an operator could act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("fail to upgrade mux for peer")


logging.getLogger("libp2p.network.swarm").addFilter(_QuietDialBacks())


def tcp_endpoint(addr: Any) -> tuple[str, int] | None:
    """(ip4, port) of a /ip4/../tcp/.. multiaddr that goes through no relay; None otherwise."""
    text = str(addr)
    if "/p2p-circuit" in text:
        return None
    parts = text.split("/")
    try:
        return parts[parts.index("ip4") + 1], int(parts[parts.index("tcp") + 1])
    except (ValueError, IndexError):
        return None


def remote_endpoint(raw_stream: Any) -> tuple[str, int] | None:
    """The peer's address as this side of a direct connection sees it (its NAT's public side)."""
    try:
        remote = raw_stream.muxed_conn.get_remote_address()
    except Exception:  # relayed and exotic connections have no socket address
        return None
    if not remote or not isinstance(remote, tuple) or len(remote) < 2:
        return None
    return str(remote[0]), int(remote[1])


async def _read_all(raw_stream: Any, max_bytes: int) -> bytes:
    data = bytearray()
    while len(data) <= max_bytes:
        try:
            chunk = await raw_stream.read(max_bytes + 1 - len(data))
        except StreamEOF:
            return bytes(data)
        if not chunk:
            return bytes(data)
        data += chunk
    raise ValueError(f"autonat message over {max_bytes} bytes")


async def dial_back(raw_host: Any, peer_id: ID, ip: str, port: int) -> bool:
    """A fresh TCP connection to ip:port that completes a Noise handshake with peer_id."""
    addr = multiaddr.Multiaddr(f"/ip4/{ip}/tcp/{port}")
    network = raw_host.get_network()
    transport = network.transport_manager.transport_for_dialing(addr)
    if transport is None:
        return False
    raw_conn = None
    with trio.move_on_after(DIAL_BACK_TIMEOUT_S):
        try:
            raw_conn = await transport.dial(addr)
            secured = await network.upgrader.upgrade_security(raw_conn, True, peer_id)
            await secured.close()
            return True
        except Exception as exc:  # refused, reset, wrong key: all mean "not reachable there"
            log.debug("dial-back to %s at %s:%d failed: %r", peer_id, ip, port, exc)
        finally:
            if raw_conn is not None:
                with trio.move_on_after(1.0, shield=True):
                    try:
                        await raw_conn.close()
                    except Exception:
                        pass
    return False


async def serve_dial_back(raw_host: Any, raw_stream: Any) -> None:
    """Answer one request: {"ports": [...]} -> {"observed": "ip:port", "reachable": {port: bool}}."""
    peer_id = raw_stream.muxed_conn.peer_id
    request = msgpack.unpackb(await _read_all(raw_stream, MAX_MESSAGE_BYTES))
    ports = request.get("ports", []) if isinstance(request, dict) else []
    ports = sorted({p for p in ports if isinstance(p, int) and 0 < p < 65536})[:MAX_DIAL_BACKS]
    # Over a relayed connection the socket's far end is the relay, not the asker.
    relayed = any("/p2p-circuit" in str(a) for a in raw_stream.muxed_conn.get_transport_addresses())
    observed = None if relayed else remote_endpoint(raw_stream)
    reachable: dict[int, bool] = {}
    if observed is not None:
        for port in ports:
            reachable[port] = await dial_back(raw_host, peer_id, observed[0], port)
    reply = {"observed": f"{observed[0]}:{observed[1]}" if observed else "", "reachable": reachable}
    await raw_stream.write(msgpack.packb(reply))
    await raw_stream.close()


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    server: str
    observed_ip: str
    reachable_ports: tuple[int, ...]
    asked_ports: tuple[int, ...]


async def ask(raw_host: Any, server: ID, ports: list[int]) -> Answer | None:
    """Ask one peer to dial us back; None when it does not speak the protocol or does not answer."""
    try:
        with trio.fail_after(ASK_TIMEOUT_S):
            stream = await raw_host.new_stream(server, [TProtocol(PROTOCOL)])
            try:
                await stream.write(msgpack.packb({"ports": ports}))
                await stream.close_write()
                reply = msgpack.unpackb(await _read_all(stream, MAX_MESSAGE_BYTES), strict_map_key=False)
            finally:
                with trio.move_on_after(1.0, shield=True):
                    try:
                        await stream.close()
                    except Exception:
                        pass
    except Exception as exc:  # unreachable, refused, timed out, malformed: no answer from this one
        log.debug("autonat request to %s failed: %r", server, exc)
        return None
    if not isinstance(reply, dict) or not isinstance(reply.get("observed"), str) or ":" not in reply["observed"]:
        return None
    reachable = reply.get("reachable", {})
    ok = tuple(sorted(p for p, v in reachable.items() if isinstance(p, int) and v is True)) \
        if isinstance(reachable, dict) else ()
    return Answer(server=str(server), observed_ip=reply["observed"].rsplit(":", 1)[0],
                  reachable_ports=ok, asked_ports=tuple(ports))


@dataclass
class Verdict:
    """The latest answer from each server and what they add up to."""

    answers: dict[str, Answer] = field(default_factory=dict)

    def add(self, answer: Answer) -> None:
        self.answers[answer.server] = answer

    def status(self) -> tuple[str, str]:
        """("public" | "private" | "unknown", why)."""
        answers = list(self.answers.values())
        ok = [a for a in answers if a.reachable_ports]
        failed = [a for a in answers if not a.reachable_ports]
        need = min(MIN_CONFIRMATIONS, max(1, len(answers)))
        ips = sorted({a.observed_ip for a in answers})
        ports = sorted({p for a in answers for p in a.asked_ports})
        where = f"{'/'.join(ips) or '?'} port {','.join(map(str, ports)) or '?'}"
        if not answers:
            return "unknown", "no peer has answered a dial-back request yet"
        if len(ok) >= need and len(ok) > len(failed):
            return "public", f"{len(ok)} of {len(answers)} peer(s) dialed back {where} on fresh connections"
        if len(failed) >= need and len(failed) > len(ok):
            return "private", (f"{len(failed)} of {len(answers)} peer(s) could not dial back {where} "
                               f"on fresh connections (behind NAT or a firewall)")
        return "unknown", f"{len(ok)} of {len(answers)} dial-back(s) to {where} succeeded; waiting for more"

    def public_endpoints(self) -> list[tuple[str, int]]:
        return sorted({(a.observed_ip, p) for a in self.answers.values() for p in a.reachable_ports})

    def observed_ips(self) -> list[str]:
        return sorted({a.observed_ip for a in self.answers.values()})
