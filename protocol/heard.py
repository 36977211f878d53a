"""When peers were last heard, with a count of liveness changes, so cached decisions need recomputing only when one happens."""

from __future__ import annotations

import heapq


class HeardLog:
    """Last-heard times of peers, and how often some peer went quiet or came back.

    A peer is live while less than ``quiet_after_s`` has passed since it was last heard. ``changes``
    rises whenever that flips for some peer, so a caller that cached a result computed from liveness
    at one time can tell, at a later one, that no peer's liveness moved in between (the count is the
    same) without looking at every peer. One log can be shared by many machines that hear the same
    peers (a simulation's partition group): the heartbeats are then recorded once, not once a machine.
    """

    __slots__ = ("times", "quiet_after_s", "_changes", "_heard_at", "_counted_from")

    def __init__(self, quiet_after_s: float) -> None:
        self.times: dict[str, float] = {}
        self.quiet_after_s = quiet_after_s
        self._changes = 0
        self._counted_from = float("-inf")
        self._heard_at: list[tuple[float, str]] = []
        """(time, peer) for every time a peer was heard: a heap, the oldest first; each entry whose
        time is still the peer's last is a peer going quiet at quiet_after_s after it."""

    def hear(self, peer: str, t: float) -> None:
        old = self.times.get(peer)
        if old is not None and t <= old:
            return
        if old is None or t - old >= self.quiet_after_s or old <= self._counted_from < t:
            self._changes += 1  # new, back from quiet, or new to a reader that counts from after its last time
        self.times[peer] = t
        heapq.heappush(self._heard_at, (t, peer))

    def count_from(self, t: float) -> None:
        """A reader takes only times after ``t`` from this log (a node that joined at t)."""
        self._counted_from = max(self._counted_from, t)

    def hear_all(self, peers, t: float) -> None:
        for peer in peers:
            self.hear(peer, t)

    def changes(self, now: float) -> int:
        """Liveness changes so far: every peer heard new or again after going quiet, every peer quiet by ``now``.

        A peer heard again after it went quiet but before this was asked counts once, not twice:
        the count still moves, which is all a cache needs."""
        heap, times, quiet = self._heard_at, self.times, self.quiet_after_s
        # The same comparison as TaskMachine.live, so the two never disagree on a rounding.
        while heap and now - heap[0][0] >= quiet:
            t, peer = heapq.heappop(heap)
            if times[peer] == t:
                self._changes += 1
        return self._changes
