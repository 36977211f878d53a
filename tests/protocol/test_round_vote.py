"""The round vote and the chosen aggregate: what one peer claims alone decides neither."""

import hashlib

from protocol.round import Head, vote
from protocol.task import WeightsAnnounce

TASK = "ab" * 32
X, Y = "11" * 32, "22" * 32


def announce(peer: str, weights: str, work: int) -> WeightsAnnounce:
    return WeightsAnnounce(task_id=TASK, round=5, peer_id=peer, weights_hash=weights, state_hash=weights,
                           state_manifest="33" * 32, eval_loss=1.0, work=work)


def test_one_node_claiming_more_work_does_not_outvote_the_others():
    mine = Head(round=6, weights_hash=X, state_hash=X, work=40)
    others = {"b": announce("b", X, 40), "c": announce("c", X, 40), "d": announce("d", Y, 41)}
    assert vote(mine, others) == (X, 3, 1)
    # Even a claim of far more work: the work in a WeightsAnnounce is the voter's own word.
    others["d"] = announce("d", Y, 10**9)
    assert vote(mine, others) == (X, 3, 1)


def test_equal_groups_are_decided_by_work_then_by_the_smaller_hash():
    mine = Head(round=6, weights_hash=Y, state_hash=Y, work=41)
    others = {"b": announce("b", X, 40), "c": announce("c", X, 40), "d": announce("d", Y, 41)}
    assert vote(mine, others) == (Y, 2, 2)
    others["d"] = announce("d", Y, 40)
    mine = Head(round=6, weights_hash=Y, state_hash=Y, work=40)
    assert vote(mine, others) == (X, 2, 2)


def test_an_aggregate_listing_a_producer_nobody_holds_gains_nothing_by_it():
    from protocol.round import choose_aggregate
    from protocol.task import AggregateAnnounce

    def agg(aggregator, included, result):
        included = tuple(sorted(included))
        return AggregateAnnounce(task_id=TASK, round=5, slice=0, aggregator=aggregator, included=included,
                                 inputs=tuple(hashlib.sha256(p.encode()).hexdigest() for p in included),
                                 manifest_id=result, result_hash=result)

    honest = agg("a", ["p", "q", "r"], "ff" * 32)
    liar = agg("z", ["p", "q", "r", "invented"], "00" * 32)
    assert choose_aggregate([honest, liar]) is liar  # counted blindly, the invented producer won the slice
    assert choose_aggregate([honest, liar], held={"p", "q", "r"}) is honest
    # An aggregate with an update this node missed still beats one without it when nothing else differs.
    fuller = agg("b", ["p", "q", "r", "s"], "ee" * 32)
    assert choose_aggregate([honest, fuller], held={"p", "q", "r", "s"}) is fuller
