"""Super-seeding decisions: one copy per shard, duplicates only for a receiver with no other source."""

from protocol.manifest import STATUS_OK, STATUS_SEEDED

from node.shardcast.seed import Seed


def test_each_shard_goes_out_once_while_the_swarm_can_spread_it():
    seed = Seed(num_shards=2, reseed_after_s=3.0)
    assert seed.decide(0, fallback=False, others_hold=False, now=0.0) == STATUS_OK
    started = seed.begin(0, 0.0)
    # In flight: another receiver is sent elsewhere, even with fallback, until the copy is overdue.
    assert seed.decide(0, fallback=True, others_hold=False, now=0.5) == STATUS_SEEDED
    assert seed.decide(1, fallback=False, others_hold=False, now=0.5) == STATUS_OK
    seed.end(0, started, 1.0, ok=True)
    assert seed.sent == [1, 0] and list(seed.recent_upload_s) == [1.0]
    assert seed.decide(0, fallback=False, others_hold=False, now=10.0) == STATUS_SEEDED
    assert seed.decide(0, fallback=True, others_hold=True, now=10.0) == STATUS_SEEDED
    # Holders exist but the asker cannot use them: past four reseed waits its word wins.
    assert seed.decide(0, fallback=True, others_hold=True, now=13.5) == STATUS_OK
    # Nobody announces it long after it went out: its recipient left, so send it again.
    assert seed.decide(0, fallback=True, others_hold=False, now=2.0) == STATUS_SEEDED
    assert seed.decide(0, fallback=True, others_hold=False, now=4.5) == STATUS_OK


def test_an_overdue_upload_gets_one_more_copy_not_one_per_request():
    seed = Seed(num_shards=1, reseed_after_s=3.0)
    for _ in range(3):
        seed.end(0, seed.begin(0, 0.0), 1.0, ok=False)  # failed uploads never count as sent
    assert seed.sent == [0] and not seed.inflight
    seed.recent_upload_s.extend([1.0, 1.0, 1.0])
    slow = seed.begin(0, 10.0)
    assert seed.slow_after_s() == 2.0
    assert seed.decide(0, fallback=True, others_hold=False, now=11.0) == STATUS_SEEDED
    assert seed.decide(0, fallback=True, others_hold=False, now=12.5) == STATUS_OK
    seed.begin(0, 12.5)
    assert seed.decide(0, fallback=True, others_hold=False, now=13.0) == STATUS_SEEDED
    seed.end(0, slow, 20.0, ok=True)
    assert 0 in seed.inflight and seed.sent == [1]


def test_a_stranded_shard_waits_as_long_as_recipients_take_to_announce_what_they_got():
    seed = Seed(num_shards=4, reseed_after_s=3.0)
    assert seed.unheard_after_s() == 3.0  # nothing measured yet
    for i, peer in enumerate("abc"):
        seed.end(i, seed.begin(i, 0.0), 1.0, ok=True, peer=peer)
    # Busy recipients announce late: 5 s after their copy arrived. Only the recipient's own Have counts, once.
    seed.heard("x", {0, 1, 2}, 2.0)
    for i, peer in enumerate("abc"):
        seed.heard(peer, {i}, 6.0)
        seed.heard(peer, {i}, 7.0)
    assert list(seed.have_delay_s) == [5.0, 5.0, 5.0] and not seed.awaiting_have
    assert seed.unheard_after_s() == 10.0
    seed.end(3, seed.begin(3, 1.0), 1.0, ok=True, peer="d")
    assert seed.decide(3, fallback=True, others_hold=False, now=5.0) == STATUS_SEEDED  # its Have is not late yet
    assert seed.decide(3, fallback=True, others_hold=False, now=11.5) == STATUS_OK and seed.reason == "unheard"
    # However late Haves get, a stranded shard waits at most four reseed waits.
    seed.have_delay_s.extend([60.0] * 8)
    assert seed.unheard_after_s() == 12.0
