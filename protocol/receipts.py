"""Receipts: which producers' updates a round's agreed weights were made of.

When a round closes with this node's weights equal to the vote's winner, the aggregates it applied name
exactly the producers (and the signed updates) that went into θ_{r+1}. Every honest node that agreed
applied the same aggregates, so every such node credits the same producers with the same slices: the
credits are a deterministic function of the round's agreed history, and two honest ledgers of a task
agree on every round both hold. A node seals one Receipt per credited producer with its own key, so a
producer (or an initiator paying for work) can show what a given node accepted.

A ledger file is a sequence of frames, each a 4-byte big-endian length and a sealed Receipt; a torn
last frame (a crash mid-write) is skipped, never trusted.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgpack

from protocol.codec import message
from protocol.envelope import Signed, open_sealed
from protocol.errors import RemoteProtocolError
from protocol.task import MAX_ROUNDS, MAX_SLICES, AggregateAnnounce, UpdateAnnounce, _check_id, _check_task, _is_hex_hash, _need

MAX_RECEIPT_BYTES = 1024
"""A sealed receipt is about 400 bytes; a longer frame in a ledger is damage, not a receipt."""
_FRAME = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class Credit:
    """A producer's part in a round's agreed weights."""

    producer: str
    samples: int
    """The samples its update claims (the largest among the updates its slices came from: a producer that
    restarted mid-round signs a second one)."""
    slices: int
    """How many of the round's slices included its update."""


@message(tag=34)
@dataclass(frozen=True, slots=True, kw_only=True)
class Receipt:
    """Sealed by the node that applied round ``round`` of ``task_id`` and agreed on ``weights_hash`` (θ_{round+1}):
    ``producer``'s update went into ``slices`` of the round's ``num_slices`` slices."""

    task_id: str
    round: int
    producer: str
    samples: int
    slices: int
    num_slices: int
    weights_hash: str

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _check_id(self.producer, "producer")
        _need(0 <= self.round < MAX_ROUNDS, "round out of range")
        _need(1 <= self.samples < 2**40, "samples must be positive")
        _need(1 <= self.num_slices <= MAX_SLICES and 1 <= self.slices <= self.num_slices,
              "slices must be within 1..num_slices")
        _need(_is_hex_hash(self.weights_hash), "weights_hash must be a hex sha256")

    @property
    def share(self) -> float:
        """The share of the producer's update that counted: 1.0 when every slice included it."""
        return self.slices / self.num_slices


def credits_for(chosen: Sequence[AggregateAnnounce],
                heard: Mapping[str, Sequence[UpdateAnnounce]]) -> tuple[Credit, ...] | None:
    """The producers the applied aggregates ``chosen`` (one per slice) include, sorted by peer id; None
    when some listed update was not heard here (a joiner following rounds it was not part of), since its
    samples are then unknown and the receipts could differ from other nodes'.

    ``heard`` holds the updates this node heard in the round, per producer."""
    slices: dict[str, int] = {}
    samples: dict[str, int] = {}
    for a in chosen:
        s = a.slice
        for p, mid in zip(a.included, a.inputs):
            # The most any heard update of p with this slice claims (a loop, not a list: every node runs this for
            # every member at every round's close).
            most = None
            for u in heard.get(p, ()):
                ids = u.manifest_ids
                if s < len(ids) and ids[s] == mid and (most is None or u.samples > most):
                    most = u.samples
            if most is None:
                return None
            slices[p] = slices.get(p, 0) + 1
            if most > samples.get(p, most - 1):
                samples[p] = most
    return tuple(Credit(p, samples[p], slices[p]) for p in sorted(slices))


def receipts_for(task_id: str, round_index: int, weights_hash: str, num_slices: int,
                 credits: Iterable[Credit]) -> list[Receipt]:
    return [Receipt(task_id=task_id, round=round_index, producer=c.producer, samples=c.samples, slices=c.slices,
                    num_slices=num_slices, weights_hash=weights_hash) for c in credits]


def frame(sealed: bytes) -> bytes:
    return _FRAME.pack(len(sealed)) + sealed


@dataclass(frozen=True, slots=True)
class LedgerRead:
    receipts: list[Signed]
    """Valid receipts in file order (a round recorded twice keeps both; ``latest`` picks)."""
    invalid: int
    """Frames that did not open as a receipt sealed by its claimed signer for the expected task."""
    torn: bool
    """The file ends inside a frame (a write cut short): that frame is ignored."""
    end: int
    """Where the last whole frame ends: a writer appends from here (what follows is torn or damaged)."""


def parse_ledger(data: bytes, *, task_id: str | None = None) -> LedgerRead:
    """Every receipt in a ledger file's bytes, each signature checked."""
    out: list[Signed] = []
    invalid, pos = 0, 0
    while pos + _FRAME.size <= len(data):
        (n,) = _FRAME.unpack_from(data, pos)
        if n > MAX_RECEIPT_BYTES:
            return LedgerRead(out, invalid + 1, False, pos)  # a damaged length: nothing after it can be framed
        if pos + _FRAME.size + n > len(data):
            break
        body = data[pos + _FRAME.size:pos + _FRAME.size + n]
        pos += _FRAME.size + n
        try:
            signed = open_sealed(body, max_bytes=MAX_RECEIPT_BYTES, expect=Receipt)
        except (RemoteProtocolError, ValueError):
            invalid += 1
            continue
        if task_id is not None and signed.message.task_id != task_id:
            invalid += 1
            continue
        out.append(signed)
    return LedgerRead(out, invalid, pos < len(data), pos)


def latest(receipts: Iterable[Receipt]) -> list[Receipt]:
    """One receipt per (round, producer), the last recorded winning (a round closed again after a restart),
    sorted by round and producer."""
    by_key = {(r.round, r.producer): r for r in receipts}
    return [by_key[k] for k in sorted(by_key)]


def digest(receipts: Iterable[Receipt]) -> str:
    """A hash of what receipts say, not who sealed them: two honest nodes' ledgers over the same rounds
    have the same digest."""
    h = hashlib.sha256()
    for r in latest(receipts):
        h.update(msgpack.packb([r.round, r.producer, r.samples, r.slices, r.num_slices, r.weights_hash]))
    return h.hexdigest()
