"""Rendezvous hashing: deterministic, order-free, and a balanced shard assignment."""

import pytest

from protocol.rendezvous import assign_shards, checker, make_key, rank, score, top

PEERS = [f"peer-{i}" for i in range(7)]


def test_rank_is_deterministic_and_ignores_input_order():
    key = make_key("task", 3)
    assert rank(key, PEERS) == rank(key, list(reversed(PEERS)))
    assert rank(key, PEERS)[0] == max(PEERS, key=lambda p: score(key, p))
    assert top(key, PEERS, 3) == rank(key, PEERS)[:3]
    assert top(key, PEERS, 100) == rank(key, PEERS)


def test_key_parts_are_unambiguous():
    assert make_key("ab", 1) != make_key("a", "b1")
    assert make_key(1) != make_key("1")


def test_removing_a_peer_only_moves_its_own_keys():
    keys = [make_key("shard", s) for s in range(200)]
    before = {k: rank(k, PEERS)[0] for k in keys}
    after = {k: rank(k, PEERS[1:])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == PEERS[0] for k in moved)


@pytest.mark.parametrize("num_peers,num_shards", [(1, 5), (3, 3), (4, 10), (7, 64), (5, 4)])
def test_assignment_covers_each_shard_once_and_balances(num_peers, num_shards):
    peers = PEERS[:num_peers]
    got = assign_shards("task-a", 2, peers, num_shards)
    flat = sorted(s for shards in got.values() for s in shards)
    assert flat == list(range(num_shards))
    counts = [len(v) for v in got.values()]
    assert max(counts) - min(counts) <= 1
    if num_shards >= num_peers:
        assert min(counts) >= 1
    assert got == assign_shards("task-a", 2, list(reversed(peers)), num_shards)


def test_assignment_changes_with_round_and_task():
    a = assign_shards("task-a", 0, PEERS, 70)
    assert a != assign_shards("task-a", 1, PEERS, 70)
    assert a != assign_shards("task-b", 0, PEERS, 70)


def test_per_peer_caps_the_round():
    got = assign_shards("task-a", 0, PEERS[:3], 20, per_peer=2)
    assert [len(v) for v in got.values()] == [2, 2, 2]
    assert len({s for v in got.values() for s in v}) == 6


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError):
        assign_shards("t", 0, ["a", "a"], 3)
    with pytest.raises(ValueError):
        assign_shards("t", 0, ["a"], -1)
    with pytest.raises(ValueError):
        top(b"k", ["a"], -1)
    assert assign_shards("t", 0, [], 3) == {}


def test_a_producer_is_checked_by_one_other_candidate_the_same_whatever_the_order():
    peers = [f"peer-{i}" for i in range(6)]
    chosen = {p: checker("t", 3, p, peers) for p in peers}
    assert all(c != p and c in peers for p, c in chosen.items())
    assert all(checker("t", 3, p, list(reversed(peers)) + [p]) == c for p, c in chosen.items())
    # Spread over the candidates, and drawn again each round.
    assert len(set(chosen.values())) > 1
    assert any(checker("t", r, "peer-0", peers) != chosen["peer-0"] for r in range(4, 12))
    assert checker("t", 3, "peer-0", ["peer-0"]) is None and checker("t", 3, "peer-0", []) is None
