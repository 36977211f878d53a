"""Checking aggregates: which were recomputed, what their inputs gave, and who was proven to lie.

An aggregate is a deterministic function of the producers' slices it lists (AggregateAnnounce.key()),
so two aggregates with one key and two results cannot both be honest, and a recomputation from the
listed inputs says which is. A signed aggregate whose result differs from its inputs' is a proof
against its signer: the node that finds one gossips it (AggregateProof), every node that holds the
inputs recomputes it, and each bans the signer for the rest of the task. An accuser whose proof
recomputes to the accused result is charged instead.

Sans-IO like the task machine that owns it: the machine asks for recomputations with Verify effects
and feeds the answers back as Verified events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.envelope import open_sealed
from protocol.errors import RemoteProtocolError
from protocol.task import AggregateAnnounce, AggregateProof

Key = tuple
"""AggregateAnnounce.key(): round, slice, then what the aggregate is a function of."""

MAX_ACCUSATIONS_PER_KEY = 8
"""Accusers remembered per aggregate key while it is recomputed; the rest are judged by the verdict alone."""


@dataclass(frozen=True, slots=True)
class Input:
    """One slice an aggregate lists: its producer, the manifest (which its producer must have signed, labelled
    for this round and slice), and the samples the producer's update claims (None: that update was not heard,
    so a samples-weighted rule cannot be recomputed)."""

    producer: str
    manifest_id: str
    samples: int | None


@dataclass(frozen=True, slots=True)
class Verify:
    """Recompute slice ``slice`` of ``round`` from exactly these inputs (sorted by producer) with the task's
    aggregation rule; answer Verified with ``key`` and the result's hash. ``screened``: the slices the
    aggregate says the screen left out, with why; the screen over inputs and these together must leave out
    exactly these, for exactly these reasons, or the answer is UNDECODABLE."""

    round: int
    slice: int
    inputs: tuple[Input, ...]
    key: Key
    screened: tuple[tuple[Input, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Verified:
    """A Verify's answer: the recomputed result's hash, or None when its inputs could not all be fetched."""

    key: Key
    result_hash: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Accused:
    """A peer gossiped a proof that ``aggregate``, sealed by its aggregator, does not match its inputs."""

    aggregate: AggregateAnnounce
    accuser: str


@dataclass(frozen=True, slots=True)
class Forged:
    """``aggregate`` does not match its inputs, which give ``result_hash``: its aggregator is banned from the
    task. ``prove``: this node found it (gossip the proof); otherwise it confirmed a peer's proof."""

    aggregate: AggregateAnnounce
    result_hash: str
    prove: bool


@dataclass(frozen=True, slots=True)
class FalseAccusation:
    """``accuser`` gossiped a proof against ``aggregate``, which recomputes to exactly its announced result."""

    accuser: str
    aggregate: AggregateAnnounce


UNDECODABLE = "0" * 64
"""The verdict for inputs of which one is no slice of this round by its producer (not signed by it, labelled
for another round or slice, or not decoding), or that the screen judges otherwise than the aggregate says:
no honest aggregate lists such a slice."""


@dataclass
class Audit:
    banned: set[str] = field(default_factory=set)
    """Peers proven to lie (a signed aggregate its inputs contradict, a signed update no honest node can make):
    nothing of theirs counts for the rest of the task."""
    verdicts: dict[Key, str | None] = field(default_factory=dict)
    """Per aggregate key, what its inputs give (None: they could not be fetched)."""
    asked: set[Key] = field(default_factory=set)
    accusations: dict[Key, list[tuple[str, AggregateAnnounce]]] = field(default_factory=dict)
    forged: list[Forged] = field(default_factory=list)
    """Every forgery this node established or confirmed, for operators (bounded by the bans: one each)."""

    def own(self, a: AggregateAnnounce) -> None:
        """Our own aggregate is its inputs' result: we computed it."""
        self.verdicts[a.key()] = a.result_hash

    def verdict(self, key: Key) -> tuple[bool, str | None]:
        """(known, result): whether the key was recomputed (or is our own), and what it gave."""
        if key in self.verdicts:
            return True, self.verdicts[key]
        return False, None

    def ask(self, a: AggregateAnnounce, inputs: tuple[Input, ...],
            screened: tuple[tuple[Input, str], ...] = ()) -> list[Verify]:
        """A Verify for ``a``'s key, unless one is under way or answered."""
        key = a.key()
        if key in self.asked or key in self.verdicts:
            return []
        self.asked.add(key)
        return [Verify(a.round, a.slice, inputs, key, screened)]

    def accuse(self, accuser: str, a: AggregateAnnounce) -> None:
        waiting = self.accusations.setdefault(a.key(), [])
        if len(waiting) < MAX_ACCUSATIONS_PER_KEY and all(p != accuser for p, _ in waiting):
            waiting.append((accuser, a))

    def answer(self, ev: Verified) -> list[tuple[str, AggregateAnnounce]]:
        """Record a verdict; returns the accusations that waited for it."""
        self.asked.discard(ev.key)
        self.verdicts[ev.key] = ev.result_hash
        return self.accusations.pop(ev.key, [])

    def judge(self, a: AggregateAnnounce, *, accuser: str | None = None) -> list:
        """Forged (and a ban) when ``a`` contradicts its key's verdict; FalseAccusation when an accuser was wrong."""
        known, result = self.verdict(a.key())
        if not known or result is None or a.aggregator in self.banned:
            return []
        if a.result_hash != result:
            self.banned.add(a.aggregator)
            forged = Forged(a, result, prove=accuser is None)
            self.forged.append(forged)
            return [forged]
        return [FalseAccusation(accuser, a)] if accuser is not None else []

    def forget_before(self, r: int) -> None:
        for key in [k for k in self.verdicts if k[0] < r]:
            del self.verdicts[key]
        for key in [k for k in self.accusations if k[0] < r]:
            del self.accusations[key]
        self.asked = {k for k in self.asked if k[0] >= r}


def open_proof(proof: AggregateProof, task_id: str, *, max_bytes: int) -> Accused | str:
    """The accusation a proof makes, or the penalty reason for a proof that is none: an aggregate its
    named aggregator did not sign, or one of another task."""
    try:
        inner = open_sealed(proof.aggregate, max_bytes=max_bytes, expect=AggregateAnnounce)
    except RemoteProtocolError:
        return "malformed"
    if inner.signer != inner.message.aggregator or inner.message.task_id != task_id:
        return "impersonation"
    return Accused(aggregate=inner.message, accuser=proof.accuser)
