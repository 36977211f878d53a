"""Super-seeding: a publisher sends each shard to about one receiver and lets the swarm spread it."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from protocol.manifest import STATUS_OK, STATUS_SEEDED


@dataclass
class Seed:
    """A manifest this node published, and what it has already sent of it.

    A shard goes out once. A duplicate goes out only to a receiver that has no other source
    (``fallback``) while no other peer announces the shard, and only once the first copy is
    overdue: still in flight well past a typical upload (a slow first recipient), or finished
    longer ago than a Have takes to come back (the recipient left, or its Have was lost). So the
    publisher's upload stays near one copy of the set, and no shard is stranded with it.

    How long a Have takes to come back is measured: from the end of each shard's first upload to
    the first Have of its recipient that lists it. Busy recipients announce late, and a wait
    shorter than that would send copies nobody needed.
    """

    num_shards: int
    reseed_after_s: float
    sent: list[int] = field(init=False)
    done_at: list[float] = field(init=False)
    inflight: dict[int, list[float]] = field(default_factory=dict)
    """Shard index -> when each of its running uploads began."""
    recent_upload_s: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    have_delay_s: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    """Recent delays from a first upload's end to its recipient's Have of it."""
    awaiting_have: dict[str, dict[int, float]] = field(default_factory=dict)
    """Recipient -> shard -> when its first upload ended, until the recipient's Have lists it."""
    reason: str = ""
    """Why the last STATUS_OK decision sent the shard: "first", or for a copy again "overdue" (the first copy is
    still in flight, long past a typical upload), "unheard" (nobody announced it since it went out) or
    "unreachable" (others announce it, but the asker says it cannot get it from them)."""

    def __post_init__(self) -> None:
        self.sent = [0] * self.num_shards
        self.done_at = [float("-inf")] * self.num_shards

    def slow_after_s(self) -> float:
        """An upload running this long is overdue: twice the median so far, and never under a second."""
        typical = statistics.median(self.recent_upload_s) if self.recent_upload_s else 0.0
        return max(1.0, 2.0 * typical)

    def unheard_after_s(self) -> float:
        """A shard whose first copy ended this long ago and that nobody announces is stranded: twice the median
        delay of a Have so far, at least ``reseed_after_s`` and at most four times it (a lost Have, or a recipient
        that left, must not hold the shard back for long)."""
        typical = statistics.median(self.have_delay_s) if self.have_delay_s else 0.0
        return min(4 * self.reseed_after_s, max(self.reseed_after_s, 2.0 * typical))

    def decide(self, index: int, *, fallback: bool, others_hold: bool, now: float) -> str:
        """STATUS_OK to send shard ``index`` now, or STATUS_SEEDED to send the requester to the swarm."""
        first = self.sent[index] == 0 and index not in self.inflight
        if first:
            return self._send("first")
        if not fallback:
            return STATUS_SEEDED
        starts = self.inflight.get(index)
        if starts:
            # The newest copy must be overdue too, or every impatient receiver would get one.
            overdue = now - max(starts) > self.slow_after_s()
            return self._send("overdue") if overdue and not others_hold else STATUS_SEEDED
        since_s = now - self.done_at[index]
        # Holders we know of may be unreachable from the asker (failed, overloaded): past a longer wait,
        # its word that it has no other source wins, so no shard can be stranded (one copy per wait at most).
        if others_hold:
            return self._send("unreachable") if since_s > 4 * self.reseed_after_s else STATUS_SEEDED
        return self._send("unheard") if since_s > self.unheard_after_s() else STATUS_SEEDED

    def _send(self, reason: str) -> str:
        self.reason = reason
        return STATUS_OK

    def begin(self, index: int, now: float) -> float:
        self.inflight.setdefault(index, []).append(now)
        return now

    def end(self, index: int, started: float, now: float, *, ok: bool, peer: str = "") -> None:
        starts = self.inflight.get(index, [])
        if started in starts:
            starts.remove(started)
        if not starts:
            self.inflight.pop(index, None)
        if ok and peer and self.sent[index] == 0:
            self.awaiting_have.setdefault(peer, {})[index] = now
        if ok:
            self.sent[index] += 1
            self.done_at[index] = now
            self.recent_upload_s.append(now - started)

    def heard(self, peer: str, indices: set[int], now: float) -> None:
        """``peer`` announced it holds ``indices``: each first copy it received is heard of, with its delay."""
        waiting = self.awaiting_have.get(peer)
        if not waiting:
            return
        for index in [i for i in waiting if i in indices]:
            self.have_delay_s.append(now - waiting.pop(index))
        if not waiting:
            del self.awaiting_have[peer]
