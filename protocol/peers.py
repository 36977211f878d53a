"""The peer table: who is alive, suspect or dead, driven by signed announcements and an explicit clock."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.messages import Announce


class PeerState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


class Observed(enum.Enum):
    NEW = "new"
    UPDATED = "updated"
    REVIVED = "revived"
    DUPLICATE = "duplicate"
    STALE = "stale"
    SELF = "self"
    IMPERSONATION = "impersonation"


@dataclass(kw_only=True)
class PeerRecord:
    peer_id: str
    announce: Announce
    state: PeerState
    first_seen: float
    last_seen: float
    announcements: int = 1


@dataclass(frozen=True, slots=True)
class Transition:
    peer_id: str
    old: PeerState
    new: PeerState


@dataclass(kw_only=True)
class PeerTable:
    """Membership as one node sees it. ``now`` is always passed in (seconds, any monotonic origin).

    A peer is alive while its announcements keep coming, suspect after ``suspect_after_s`` of
    silence, dead after ``dead_after_s``, and forgotten after ``forget_after_s``. Only an
    announcement with a larger sequence number than the last one counts, so duplicates and
    replays of old signed announcements cannot keep a dead peer alive.
    """

    self_id: str
    suspect_after_s: float = 5.0
    dead_after_s: float = 10.0
    forget_after_s: float = 300.0
    peers: dict[str, PeerRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.suspect_after_s <= self.dead_after_s <= self.forget_after_s:
            raise ValueError("need 0 < suspect_after_s <= dead_after_s <= forget_after_s")

    def observe(self, announce: Announce, signer: str, now: float) -> Observed:
        """Apply one verified announcement signed by ``signer``."""
        if announce.peer_id != signer:
            return Observed.IMPERSONATION
        if signer == self.self_id:
            return Observed.SELF
        record = self.peers.get(signer)
        if record is None:
            self.peers[signer] = PeerRecord(peer_id=signer, announce=announce, state=PeerState.ALIVE,
                                            first_seen=now, last_seen=now)
            return Observed.NEW
        if announce.seq == record.announce.seq:
            return Observed.DUPLICATE
        if announce.seq < record.announce.seq:
            return Observed.STALE
        was = record.state
        record.announce, record.last_seen, record.state = announce, now, PeerState.ALIVE
        record.announcements += 1
        return Observed.REVIVED if was is PeerState.DEAD else Observed.UPDATED

    def disconnected(self, peer_id: str, now: float) -> bool:
        """Our last connection to an alive peer closed (a killed process closes its sockets at once):
        it is suspect from now, as if its announcements had stopped ``suspect_after_s`` ago. Its next
        announcement, relayed by any other peer, makes it alive again. True if it was alive."""
        record = self.peers.get(peer_id)
        if record is None or record.state is not PeerState.ALIVE:
            return False
        record.last_seen = min(record.last_seen, now - self.suspect_after_s)
        record.state = PeerState.SUSPECT
        return True

    def tick(self, now: float) -> list[Transition]:
        """Advance the clock; returns the state changes it caused, in peer id order."""
        changes = []
        for peer_id in sorted(self.peers):
            record = self.peers[peer_id]
            silent_s = now - record.last_seen
            if silent_s >= self.forget_after_s:
                del self.peers[peer_id]
                continue
            new = (PeerState.DEAD if silent_s >= self.dead_after_s
                   else PeerState.SUSPECT if silent_s >= self.suspect_after_s
                   else PeerState.ALIVE)
            if new is not record.state:
                changes.append(Transition(peer_id, record.state, new))
                record.state = new
        return changes

    def in_state(self, state: PeerState) -> list[str]:
        return sorted(p for p, r in self.peers.items() if r.state is state)

    def alive(self) -> list[str]:
        return self.in_state(PeerState.ALIVE)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in PeerState}
        for record in self.peers.values():
            out[record.state.value] += 1
        return out
