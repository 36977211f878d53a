"""Scores decay and ban; the flood limiter admits a burst then the sustained rate."""

from protocol.scores import FloodLimiter, Scoreboard


def test_repeated_bad_signatures_ban_and_the_ban_expires():
    s = Scoreboard(ban_at=100, decay_per_s=1, ban_s=30)
    banned = [s.penalize("p", "bad_signature", now=0) for _ in range(4)]
    assert banned == [False, False, False, True]
    assert s.is_banned("p", now=29)
    assert not s.is_banned("p", now=30)


def test_penalties_decay():
    s = Scoreboard(decay_per_s=2)
    s.penalize("p", "malformed", now=0)
    assert s.score("p", now=0) == -10
    assert s.score("p", now=5) == 0


def test_flood_limiter_burst_then_rate():
    f = FloodLimiter(rate_per_s=10, burst=5)
    assert sum(f.allow("p", now=0) for _ in range(20)) == 5
    assert sum(f.allow("p", now=1.0) for _ in range(20)) == 5  # refilled to the burst cap
    assert f.allow("q", now=1.0)
