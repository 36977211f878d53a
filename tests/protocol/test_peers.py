"""Peer table: alive, suspect, dead by the clock; duplicates, replays and impersonation ignored."""

import pytest

from protocol.keys import Keypair
from protocol.messages import Announce, HardwareSummary
from protocol.peers import Observed, PeerState, PeerTable

ME, A, B = (Keypair.from_label(x).peer_id for x in ("me", "a", "b"))
HW = HardwareSummary(devices=("cpu",), memory_bytes=1, tflops=0.1)


def ann(peer, seq):
    return Announce(peer_id=peer, seq=seq, addrs=(), version="0", roles=(), hardware=HW)


def table():
    return PeerTable(self_id=ME, suspect_after_s=4, dead_after_s=10, forget_after_s=60)


def test_new_peer_is_alive_then_suspect_then_dead_then_forgotten():
    t = table()
    assert t.observe(ann(A, 1), A, now=0) is Observed.NEW
    assert t.tick(3.9) == []
    assert [(c.old, c.new) for c in t.tick(4)] == [(PeerState.ALIVE, PeerState.SUSPECT)]
    assert [(c.old, c.new) for c in t.tick(10)] == [(PeerState.SUSPECT, PeerState.DEAD)]
    assert t.in_state(PeerState.DEAD) == [A]
    t.tick(60)
    assert A not in t.peers


def test_dead_peer_revives_on_a_newer_announcement():
    t = table()
    t.observe(ann(A, 1), A, now=0)
    t.tick(11)
    assert t.observe(ann(A, 2), A, now=12) is Observed.REVIVED
    assert t.alive() == [A]


def test_duplicates_and_replays_do_not_refresh_liveness():
    t = table()
    t.observe(ann(A, 5), A, now=0)
    assert t.observe(ann(A, 5), A, now=8) is Observed.DUPLICATE
    assert t.observe(ann(A, 4), A, now=8) is Observed.STALE
    t.tick(10)
    assert t.peers[A].state is PeerState.DEAD


def test_announcement_for_someone_else_is_impersonation():
    t = table()
    assert t.observe(ann(A, 1), B, now=0) is Observed.IMPERSONATION
    assert t.peers == {}


def test_own_announcements_are_not_peers():
    t = table()
    assert t.observe(ann(ME, 1), ME, now=0) is Observed.SELF
    assert t.counts() == {"alive": 0, "suspect": 0, "dead": 0}


def test_thresholds_must_be_ordered():
    with pytest.raises(ValueError):
        PeerTable(self_id=ME, suspect_after_s=10, dead_after_s=5)


def test_thousand_simulated_peers_converge():
    t = table()
    peers = [Keypair.from_label(f"p{i}").peer_id for i in range(1000)]
    for i, p in enumerate(peers):
        t.observe(ann(p, 1), p, now=i * 0.001)
    for p in peers[:500]:
        t.observe(ann(p, 2), p, now=9)
    t.tick(12)
    assert t.counts() == {"alive": 500, "suspect": 0, "dead": 500}


def test_a_peer_whose_last_connection_closed_is_suspect_at_once_and_revives_on_its_next_announcement():
    t = table()
    t.observe(ann(A, 1), A, now=0)
    assert t.disconnected(A, now=1.0)
    assert t.in_state(PeerState.SUSPECT) == [A]
    assert [(c.old, c.new) for c in t.tick(7.0)] == [(PeerState.SUSPECT, PeerState.DEAD)]  # 6 s of silence, not 10
    assert not t.disconnected(A, now=7.5), "only an alive peer changes"
    assert not t.disconnected(B, now=7.5), "an unknown peer is ignored"
    assert t.observe(ann(A, 2), A, now=8) is Observed.REVIVED and t.alive() == [A]
