"""Upload slots shared among the peers asking now: the first asker cannot take them all."""

from node.shardcast.serving import FairUploads


def test_a_lone_receiver_gets_every_slot():
    slots = FairUploads(4, window_s=1.0)
    assert all(slots.take("a", now=0.0) for _ in range(4))
    assert not slots.take("a", now=0.0)  # all four are busy


def test_the_first_asker_keeps_only_its_share_once_others_ask():
    slots = FairUploads(4, window_s=1.0)
    assert all(slots.take("a", now=0.0) for _ in range(4))
    # Three more receivers are told busy, but now count as askers: a's share drops to one slot.
    assert [slots.take(p, now=0.01) for p in "bcd"] == [False, False, False]
    slots.release("a")
    assert not slots.take("a", now=0.1)  # a holds three, over its share of one
    assert slots.take("b", now=0.1)
    assert not slots.take("b", now=0.1)  # b is at its share
    for _ in range(3):
        slots.release("a")
    assert slots.take("c", now=0.2) and slots.take("d", now=0.2) and slots.take("a", now=0.2)
    assert not slots.take("a", now=0.2)


def test_a_peer_that_stopped_asking_no_longer_counts():
    slots = FairUploads(4, window_s=1.0)
    assert slots.take("b", now=0.0)
    slots.release("b")
    # b asked last at 0.0; by 2.0 it is done, and a alone may use every slot again.
    assert all(slots.take("a", now=2.0) for _ in range(4))


def test_more_askers_than_slots_still_get_one_each_in_turn():
    slots = FairUploads(2, window_s=1.0)
    taken = [slots.take(p, now=0.0) for p in "abcde"]
    assert taken == [True, True, False, False, False]
    slots.release("a")
    assert not slots.take("b", now=0.1)  # b holds its one
    assert slots.take("c", now=0.1)
