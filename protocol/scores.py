"""Peer scores and flood limits: misbehaviour costs points that decay; too many points bans a peer."""

from __future__ import annotations

from dataclasses import dataclass, field

PENALTIES = {
    "malformed": 10.0,
    "oversize": 20.0,
    "bad_signature": 25.0,
    "impersonation": 50.0,
    "flood": 5.0,
    "corrupt_shard": 40.0,
    "transfer_failed": 5.0,
    "protocol_violation": 15.0,
    "handler_error": 5.0,
    "wrong_weights": 50.0,
    # Proven by recomputation (protocol/audit.py): a signed aggregate that its own inputs contradict.
    "forged_aggregate": 1000.0,
    "false_accusation": 25.0,
    # Signed and impossible for an honest node (protocol/task_machine.py Impossible): over-claimed samples,
    # two results for one aggregate.
    "impossible_message": 100.0,
    # An update with nothing in it (zeros), found the same way by every aggregator (node/tasks/robust.py screen).
    "empty_update": 30.0,
    # An update pointing against the median of the slice's others (a sign flip): rarer than noise can explain.
    "opposed_update": 20.0,
    # An update many times larger than the slice's others (noise poured in): no honest update came close.
    "outsized_update": 20.0,
    # An update that raises the loss on the batches its producer drew (node/tasks/training_check.py): it did not
    # train on them. Measured by its checker and again by every node a proof reaches; a second finding within 4 rounds bans.
    "untrained_update": 60.0,
    "untrained_again": 100.0,
    # Refused inside the libp2p host (p2p.guards), below our own handlers.
    "gossip_rpc_malformed": 20.0,
    "gossip_rpc_oversize": 20.0,
    "gossip_rpc_too_many_entries": 20.0,
    "gossip_oversize": 20.0,
    "gossip_bad_signature": 25.0,
    "gossip_too_many_subscriptions": 10.0,
    "gossip_control_malformed": 15.0,
    "gossip_malformed": 10.0,
    "stream_error": 10.0,
    "too_many_streams": 5.0,
    "task_intake_error": 10.0,
}


@dataclass(kw_only=True)
class Scoreboard:
    """Penalty points per peer, decaying linearly at ``decay_per_s``; banned at ``ban_at`` points."""

    ban_at: float = 100.0
    decay_per_s: float = 1.0
    ban_s: float = 300.0
    points: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (points, as of)
    banned_until: dict[str, float] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)

    def _current(self, peer_id: str, now: float) -> float:
        points, as_of = self.points.get(peer_id, (0.0, now))
        return max(0.0, points - self.decay_per_s * max(0.0, now - as_of))

    def penalize(self, peer_id: str, reason: str, now: float) -> bool:
        """Charge ``peer_id`` for ``reason``; returns True if this penalty banned it."""
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        points = self._current(peer_id, now) + PENALTIES.get(reason, 10.0)
        self.points[peer_id] = (points, now)
        if points >= self.ban_at and not self.is_banned(peer_id, now):
            self.banned_until[peer_id] = now + self.ban_s
            return True
        return False

    def score(self, peer_id: str, now: float) -> float:
        return -self._current(peer_id, now)

    def is_banned(self, peer_id: str, now: float) -> bool:
        until = self.banned_until.get(peer_id)
        if until is None:
            return False
        if now >= until:
            del self.banned_until[peer_id]
            return False
        return True


@dataclass(kw_only=True)
class FloodLimiter:
    """A token bucket per key (e.g. forwarding peer): ``rate_per_s`` sustained, ``burst`` at once."""

    rate_per_s: float = 20.0
    burst: float = 50.0
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def allow(self, key: str, now: float) -> bool:
        tokens, as_of = self.buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + self.rate_per_s * max(0.0, now - as_of))
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return False
        self.buckets[key] = (tokens - 1.0, now)
        return True
