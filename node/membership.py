"""Membership: signed announcements over gossip and a hello exchange on connect, feeding the peer table.

It also keeps the swarm connected: bootstrap peers are redialled in the background, announced
peers are dialled directly (so bulk transfers never need a relay), and peers that misbehave
are penalized, disconnected and ignored.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from node.config import NodeConfig
from node.netaddrs import expand_unspecified
from p2p.api import GossipMessage, Host, Stream
from p2p.framing import read_frame, write_frame
from protocol.envelope import Signed, open_sealed, seal
from protocol.errors import (DecodeError, OversizeError, PeerUnreachable, RemoteProtocolError, SignatureError,
                             TransportError)
from protocol.keys import Keypair
from protocol.messages import MAX_ADDRS, Announce, HardwareSummary
from protocol.peers import Observed, PeerState, PeerTable
from protocol.scores import FloodLimiter, Scoreboard

log = logging.getLogger("shoal.membership")

ANNOUNCE_TOPIC = "shoal/announce/1"
HELLO_PROTOCOL = "/shoal/hello/1"
MAX_ANNOUNCE_BYTES = 16 * 1024
HELLO_TIMEOUT_S = 5.0
MAX_REDIAL_BACKOFF_S = 30.0
RECENT_REDIAL_BACKOFF_S = 4.0
RECENT_PEER_S = 300.0
"""Peers heard from within this long are redialled at most RECENT_REDIAL_BACKOFF_S apart."""
RELAY_BUDGET_FACTOR = 10
"""A connection may relay this many times one origin's gossip budget."""


def unix_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Traffic:
    """Message counters for /metrics: in and out by topic, drops and penalties by reason."""

    messages_in: Counter = field(default_factory=Counter)
    messages_out: Counter = field(default_factory=Counter)
    drops: Counter = field(default_factory=Counter)


_REASONS = ((OversizeError, "oversize"), (SignatureError, "bad_signature"), (DecodeError, "malformed"))


def reason_of(exc: RemoteProtocolError) -> str:
    return next((reason for kind, reason in _REASONS if isinstance(exc, kind)), "protocol_violation")


class Membership:
    def __init__(self, *, config: NodeConfig, keypair: Keypair, host: Host, hardware: HardwareSummary,
                 version: str, traffic: Traffic):
        self.config, self.keypair, self.host, self.hardware = config, keypair, host, hardware
        self.version, self.traffic = version, traffic
        # Export the topic's counters from the start, not only after the first message.
        traffic.messages_in[ANNOUNCE_TOPIC] += 0
        traffic.messages_out[ANNOUNCE_TOPIC] += 0
        self.table = PeerTable(self_id=keypair.peer_id, suspect_after_s=config.suspect_after_s,
                               dead_after_s=config.dead_after_s, forget_after_s=max(300.0, 10 * config.dead_after_s))
        self.scores = Scoreboard()
        self.flood = FloodLimiter(rate_per_s=config.gossip_rate_per_s, burst=config.gossip_burst)
        # Whatever one connection relays, from however many origins (keys cost nothing to make).
        self.relay_flood = FloodLimiter(rate_per_s=RELAY_BUDGET_FACTOR * config.gossip_rate_per_s,
                                        burst=RELAY_BUDGET_FACTOR * config.gossip_burst)
        self.status_line = ""
        self._seq = 0
        self._dialing: set[str] = set()
        self._next_dial_at: dict[str, tuple[float, float]] = {}  # peer -> (not before, backoff)
        self._to_disconnect: trio.MemorySendChannel[str]
        self._to_disconnect, self._disconnect_queue = trio.open_memory_channel(256)
        self.gone_listeners: list[Callable[[str], None]] = []
        """Called with a peer id when an alive peer's last connection closes (the task runners)."""

    # -- what we say about ourselves ----------------------------------------------------------

    def advertised_addrs(self) -> tuple[str, ...]:
        if self.config.announce_addrs:
            suffix = f"/p2p/{self.keypair.peer_id}"
            return tuple(a if "/p2p/" in a else a + suffix for a in self.config.announce_addrs)
        # A peer cannot dial 0.0.0.0: announce each interface's address instead (loopback last).
        # Behind NAT, the relayed addresses come first; confirmed public ones go first too.
        local = expand_unspecified(self.host.listen_addrs())
        r = self.host.reachability()
        first = list(r.relay_addrs) if r.status == "private" else [a for a in r.public_addrs if a not in local]
        return tuple((first + local)[:MAX_ADDRS])

    def announcement(self) -> bytes:
        # Wall-clock milliseconds keep seq increasing across restarts; +1 keeps it strictly increasing.
        self._seq = max(self._seq + 1, unix_ms())
        msg = Announce(peer_id=self.keypair.peer_id, seq=self._seq, addrs=self.advertised_addrs(),
                       version=self.version, roles=tuple(self.config.roles), hardware=self.hardware,
                       control=self.status_line[:256])
        return seal(msg, self.keypair)

    # -- judging what others send -------------------------------------------------------------

    def penalize(self, peer_id: str, reason: str) -> None:
        """Charge a peer for misbehaviour; disconnect it once banned. Safe to call from sync code."""
        self.traffic.drops[reason] += 1
        if self.scores.penalize(peer_id, reason, trio.current_time()):
            log.warning("banning peer %s (score %.0f, last offence: %s)", peer_id,
                        self.scores.score(peer_id, trio.current_time()), reason)
            try:
                self._to_disconnect.send_nowait(peer_id)
            except trio.WouldBlock:
                pass

    def is_gone(self, peer_id: str) -> bool:
        """Known to the peer table and no longer alive: its connections closed, or silent past suspect_after_s
        (a peer never heard, or forgotten, is not judged)."""
        record = self.table.peers.get(peer_id)
        return record is not None and record.state is not PeerState.ALIVE

    def is_banned(self, peer_id: str) -> bool:
        return self.scores.is_banned(peer_id, trio.current_time())

    def check_gossip(self, msg: GossipMessage, *, max_bytes: int, expect: type) -> Signed | None:
        """Shared gate for every gossip topic: bans, flood limit, size, decoding and signature."""
        now = trio.current_time()
        if self.scores.is_banned(msg.forwarder, now) or self.scores.is_banned(msg.origin, now):
            self.traffic.drops["banned"] += 1
            return None
        if not self.flood.allow(msg.origin, now):
            self.penalize(msg.origin, "flood")
            return None
        if not self.relay_flood.allow(msg.forwarder, now):
            # Not charged: an honest relay forwards floods it did not make; their origins pay above.
            self.traffic.drops["flood_relayed"] += 1
            return None
        try:
            signed = open_sealed(msg.data, max_bytes=max_bytes, expect=expect)
        except RemoteProtocolError as exc:
            # Gossipsub's strict signing ties the message to its origin: the origin made it.
            self.penalize(msg.origin, reason_of(exc))
            return None
        return signed

    def _validate(self, msg: GossipMessage) -> bool:
        signed = self.check_gossip(msg, max_bytes=MAX_ANNOUNCE_BYTES, expect=Announce)
        if signed is None:
            return False
        if signed.message.peer_id != signed.signer:
            self.penalize(msg.origin, "impersonation")
            return False
        return True

    def observe(self, signed: Signed, via: str) -> None:
        outcome = self.table.observe(signed.message, signed.signer, trio.current_time())
        if outcome is Observed.IMPERSONATION:
            self.penalize(via, "impersonation")
        elif outcome in (Observed.NEW, Observed.REVIVED):
            log.info("peer %s %s (%s)", signed.signer, "joined" if outcome is Observed.NEW else "is back",
                     ", ".join(signed.message.hardware.devices) or "no devices")
            self._next_dial_at.pop(signed.signer, None)

    # -- services -----------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # What the host refuses below our handlers (broken gossip RPCs, bad signatures) costs the sender too.
        self.host.set_offence_handler(self.penalize)
        self.host.set_stream_handler(HELLO_PROTOCOL, self._serve_hello)
        messages = self.host.subscribe(ANNOUNCE_TOPIC, self._validate)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._consume, messages)
            nursery.start_soon(self._heartbeats)
            nursery.start_soon(self._disconnect_banned)
            for addr in self.config.bootstrap:
                nursery.start_soon(self._keep_bootstrapped, addr)
            nursery.start_soon(self._dial_discovered)
            nursery.start_soon(self._watch_disconnections)
            task_status.started()

    async def _watch_disconnections(self) -> None:
        """A peer whose last connection closed is suspect at once: a SIGKILLed node's sockets close as it
        dies, seconds before its missing announcements would say so. Its next announcement revives it."""
        async for peer_id in self.host.disconnections():
            if self.table.disconnected(peer_id, trio.current_time()):
                log.info("peer %s closed its last connection; suspect until it is heard again", peer_id)
                for listener in list(self.gone_listeners):
                    listener(peer_id)

    async def _consume(self, messages) -> None:
        async for msg in messages:
            self.traffic.messages_in[ANNOUNCE_TOPIC] += 1
            try:
                signed = open_sealed(msg.data, max_bytes=MAX_ANNOUNCE_BYTES, expect=Announce)
            except RemoteProtocolError:
                continue  # already judged by the validator
            self.observe(signed, msg.forwarder)

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self.host.publish(ANNOUNCE_TOPIC, self.announcement())
                self.traffic.messages_out[ANNOUNCE_TOPIC] += 1
            except TransportError as exc:
                log.debug("announcement not published: %s", exc)
            now = trio.current_time()
            for change in self.table.tick(now):
                level = logging.WARNING if change.new is PeerState.DEAD else logging.INFO
                log.log(level, "peer %s: %s -> %s", change.peer_id, change.old.value, change.new.value)
                if change.new is PeerState.DEAD:
                    self._next_dial_at[change.peer_id] = (now, self.config.heartbeat_interval_s)
                    self._nursery.start_soon(self._probe_connection, change.peer_id)
            self._redial_known_peers()
            await trio.sleep(self.config.heartbeat_interval_s)

    async def _probe_connection(self, peer_id: str) -> None:
        """A peer went silent: say hello over its connection, and drop the connection if no answer comes.

        A cut link leaves its TCP connections open but silent; the host would keep opening streams
        on them (each shard fetch waits out its timeout) and never redial. A peer that is only slow
        answers the hello and stays connected."""
        if peer_id not in self.host.connected_peers():
            return
        await self.hello(peer_id)
        record = self.table.peers.get(peer_id)
        if record is not None and record.state is PeerState.DEAD:
            log.info("peer %s does not answer on its connection; dropping it and redialling", peer_id)
            with trio.move_on_after(self.config.dial_timeout_s):
                await self.host.disconnect(peer_id)

    async def _disconnect_banned(self) -> None:
        """Disconnect each banned peer and have the host refuse it (connections, streams, gossip) while banned."""
        async for peer_id in self._disconnect_queue:
            with trio.move_on_after(self.config.dial_timeout_s):
                try:
                    await self.host.block_peer(peer_id, self.scores.ban_s)
                except TransportError:
                    pass
                except ValueError:
                    log.warning("not blocking %r: not a peer id", peer_id)

    # -- staying connected ----------------------------------------------------------------------

    async def hello(self, peer_id: str) -> None:
        """Exchange announcements with a freshly connected peer, so neither waits for gossip."""
        with trio.move_on_after(HELLO_TIMEOUT_S):
            try:
                stream = await self.host.open_stream(peer_id, HELLO_PROTOCOL)
                try:
                    await write_frame(stream, self.announcement())
                    await stream.close_write()
                    body = await read_frame(stream, MAX_ANNOUNCE_BYTES)
                finally:
                    await stream.close()
                if body is not None:
                    self.observe(open_sealed(body, max_bytes=MAX_ANNOUNCE_BYTES, expect=Announce), peer_id)
            except RemoteProtocolError as exc:
                self.penalize(peer_id, reason_of(exc))
            except TransportError as exc:
                log.debug("hello to %s failed: %s", peer_id, exc)

    async def _serve_hello(self, stream: Stream) -> None:
        peer_id = stream.remote_peer
        if self.is_banned(peer_id):
            await stream.reset()
            return
        try:
            with trio.fail_after(HELLO_TIMEOUT_S):
                body = await read_frame(stream, MAX_ANNOUNCE_BYTES)
                if body is None:
                    raise DecodeError("hello stream ended before the announcement")
                self.observe(open_sealed(body, max_bytes=MAX_ANNOUNCE_BYTES, expect=Announce), peer_id)
                await write_frame(stream, self.announcement())
                await stream.close()
        except RemoteProtocolError as exc:
            self.penalize(peer_id, reason_of(exc))
            await stream.reset()
        except trio.TooSlowError:
            self.penalize(peer_id, "protocol_violation")
            await stream.reset()

    async def dial(self, addr: str) -> str | None:
        """Connect and say hello; None when the peer cannot be reached (already logged)."""
        try:
            with trio.fail_after(self.config.dial_timeout_s + 1):
                peer_id = await self.host.connect(addr)
        except (PeerUnreachable, trio.TooSlowError) as exc:
            log.debug("dial %s failed: %s", addr, exc)
            return None
        except ValueError as exc:
            log.warning("not dialling %s: %s", addr, exc)
            return None
        if self.is_banned(peer_id):
            await self.host.disconnect(peer_id)
            return None
        await self.hello(peer_id)
        return peer_id

    async def _keep_bootstrapped(self, addr: str) -> None:
        """Dial a bootstrap peer until connected, and again whenever the connection drops."""
        peer_id = addr.rsplit("/p2p/", 1)[-1]
        delay_s = self.config.bootstrap_retry_s
        while True:
            if peer_id not in self.host.connected_peers():
                if await self.dial(addr) is None:
                    log.info("bootstrap peer %s not reachable yet; retrying in %.0f s", addr, delay_s)
                    await trio.sleep(delay_s)
                    delay_s = min(delay_s * 2, MAX_REDIAL_BACKOFF_S)
                    continue
                log.info("connected to bootstrap peer %s", peer_id)
                delay_s = self.config.bootstrap_retry_s
            await trio.sleep(self.config.heartbeat_interval_s)

    def _redial_known_peers(self) -> None:
        """Dial announced peers we are not connected to, with per-peer exponential backoff."""
        now = trio.current_time()
        connected = set(self.host.connected_peers())
        budget = self.config.max_peers - len(connected)
        for peer_id, record in sorted(self.table.peers.items()):
            if budget <= 0:
                return
            if peer_id in connected or peer_id in self._dialing or self.is_banned(peer_id):
                continue
            not_before, backoff_s = self._next_dial_at.get(peer_id, (0.0, self.config.heartbeat_interval_s))
            if now < not_before or not record.announce.addrs:
                continue
            # A peer heard from lately (a partition, a restart) is retried every few seconds, so a
            # healed link is used again within moments; long-gone peers back off to MAX_REDIAL_BACKOFF_S.
            cap_s = RECENT_REDIAL_BACKOFF_S if now - record.last_seen < RECENT_PEER_S else MAX_REDIAL_BACKOFF_S
            self._next_dial_at[peer_id] = (now + backoff_s, min(backoff_s * 2, cap_s))
            self._dialing.add(peer_id)
            budget -= 1
            self._nursery.start_soon(self._dial_peer, peer_id, record.announce.addrs)

    async def _dial_peer(self, peer_id: str, addrs: tuple[str, ...]) -> None:
        try:
            for addr in addrs:
                if addr.endswith(f"/p2p/{peer_id}") and await self.dial(addr) == peer_id:
                    return
        finally:
            self._dialing.discard(peer_id)

    async def _dial_discovered(self) -> None:
        async for addr in self.host.discovered():
            peer_id = addr.rsplit("/p2p/", 1)[-1]
            if peer_id != self.keypair.peer_id and peer_id not in self.host.connected_peers():
                self._nursery.start_soon(self.dial, addr)
