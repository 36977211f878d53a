"""A round's pure rules: who aggregates a slice, which aggregate wins, which weights win a vote, which history wins.

Every function here is a deterministic function of signed messages, so honest nodes that saw
the same messages decide the same. The task machine (protocol/task_machine.py) is their only
caller in the node; keeping them apart lets tests and validators evaluate a rule on its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from protocol.rendezvous import make_key, top
from protocol.task import AggregateAnnounce, WeightsAnnounce


@lru_cache(maxsize=1024)
def _aggregators(task_id: str, r: int, slice_index: int, members: tuple[str, ...], k: int) -> tuple[str, ...]:
    """Pure, so memoized: simulated swarms in one process share the hashing."""
    return tuple(top(make_key("aggregate", task_id, r, slice_index), members, k))


def aggregators(task_id: str, r: int, slice_index: int, members, k: int) -> tuple[str, ...]:
    """The k members that win the rendezvous hash of (task, round, slice)."""
    return _aggregators(task_id, r, slice_index, tuple(sorted(members)), k)


def choose_aggregate(candidates, held=None) -> AggregateAnnounce:
    """Most producers covered (combined or screened out, AggregateAnnounce.accounted) wins; aggregation is deterministic, so equal inputs mean equal bytes from
    honest aggregators. Where equal coverage gives different results the smaller hash is only the
    candidate the task machine recomputes first (protocol/audit.py): it is applied only if it matches.

    ``held``: the producers whose updates this node has heard. Only those count as covered, and between
    equal coverage the aggregate listing fewer others wins: an aggregator that lists an invented producer
    gains nothing by it (it used to win every slice it aggregated). Which of a producer's updates an
    aggregate used does not rank it: a restarted producer signs a second one, and nodes that heard
    different ones must still rank alike; a slice its producer never signed is caught by recomputation."""
    if held is None:
        return min(candidates, key=lambda m: (-len(m.accounted()), m.result_hash))

    def rank(m: AggregateAnnounce) -> tuple:
        accounted = m.accounted()
        known = sum(1 for p in accounted if p in held)
        return -known, len(accounted) - known, m.result_hash
    return min(candidates, key=rank)


def round_work(chosen: tuple[AggregateAnnounce, ...]) -> int:
    """Contributions a round adds to its history: producers in the least covered slice (0 if it failed)."""
    return min((len(a.included) for a in chosen), default=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Head:
    """Weights a node holds: θ_round (the next round to run), the history's work, where to fetch them."""

    round: int
    weights_hash: str
    state_hash: str
    work: int
    peer_id: str = ""
    state_manifest: str = ""

    @classmethod
    def of(cls, msg: WeightsAnnounce) -> "Head":
        return cls(round=msg.round + 1, weights_hash=msg.weights_hash, state_hash=msg.state_hash, work=msg.work,
                   peer_id=msg.peer_id, state_manifest=msg.state_manifest)

    def rank(self) -> tuple:
        """More work first, then more rounds, then the smaller hash: the same order on every node."""
        return (-self.work, -self.round, self.weights_hash)

    def same_weights(self, other: "Head") -> bool:
        return (self.round, self.weights_hash, self.state_hash) == (other.round, other.weights_hash, other.state_hash)


def best_head(heads) -> Head | None:
    """The history every node settles on after a partition: the most verified work wins."""
    return min(heads, key=Head.rank, default=None)


def vote(mine: Head, others: dict[str, WeightsAnnounce]) -> tuple[str, int, int]:
    """(winning weights hash, votes for it, votes against) among one round's announcements and ours.

    Groups by hash; the larger group wins, then the group whose history claims more work, then the
    smaller hash (only ever between groups equal in both). Every voter applied the round to the same
    weights, so the work each claims is its own word: ranked first, one node claiming an aggregate
    that covers one more producer (or lying about it) would outvote all the others.
    """
    votes = Counter(w.weights_hash for w in others.values())
    votes[mine.weights_hash] += 1
    work = {w.weights_hash: w.work for w in others.values()}
    work[mine.weights_hash] = mine.work
    winner = min(votes, key=lambda h: (-votes[h], -work[h], h))
    return winner, votes[winner], sum(votes.values()) - votes[winner]
