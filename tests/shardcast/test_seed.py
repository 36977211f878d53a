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
