"""Receipts and ledger files: what a receipt may say, how a ledger file is read back, what its digest covers."""

from __future__ import annotations

import hashlib

import pytest

from protocol.envelope import seal
from protocol.keys import Keypair
from protocol.receipts import Credit, Receipt, credits_for, digest, frame, latest, parse_ledger, receipts_for
from protocol.task import AggregateAnnounce, UpdateAnnounce

TASK = "ab" * 32
OTHER_TASK = "cd" * 32
WEIGHTS = "ef" * 32
A = Keypair.from_label("a")


def hx(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def update(producer: str, samples: int, tag: str = "") -> UpdateAnnounce:
    return UpdateAnnounce(task_id=TASK, round=3, producer=producer, base_hash=hx("base"), samples=samples,
                          manifest_ids=(hx(producer, 0, tag), hx(producer, 1, tag)), losses=())


def aggregate(slice_index: int, updates: list[UpdateAnnounce]) -> AggregateAnnounce:
    updates = sorted(updates, key=lambda u: u.producer)
    return AggregateAnnounce(task_id=TASK, round=3, slice=slice_index, aggregator="agg",
                             included=tuple(u.producer for u in updates),
                             inputs=tuple(u.manifest_ids[slice_index] for u in updates),
                             result_hash=hx("result", slice_index), manifest_id=hx("m", slice_index))


def receipt(producer: str = "p1", round_index: int = 3, samples: int = 80, slices: int = 2) -> Receipt:
    return Receipt(task_id=TASK, round=round_index, producer=producer, samples=samples, slices=slices, num_slices=2,
                   weights_hash=WEIGHTS)


def test_credits_count_the_slices_each_producer_is_in_and_the_samples_its_listed_update_claims():
    u1, u2, u3 = update("p1", 80), update("p2", 40), update("p3", 8)
    heard = {"p1": [u1], "p2": [u2], "p3": [u3]}
    chosen = [aggregate(0, [u1, u2, u3]), aggregate(1, [u2, u1])]  # p3's slice 1 did not make it
    assert credits_for(chosen, heard) == (Credit("p1", 80, 2), Credit("p2", 40, 2), Credit("p3", 8, 1))


def test_a_producer_restarted_mid_round_is_credited_once_with_the_larger_claim_of_the_updates_listed():
    first, second = update("p1", 80, "first"), update("p1", 24, "second")
    heard = {"p1": [first, second]}
    chosen = [aggregate(0, [second]), aggregate(1, [first])]
    assert credits_for(chosen, heard) == (Credit("p1", 80, 2),)


def test_no_credits_when_a_listed_update_was_not_heard_here():
    u1, u2 = update("p1", 80), update("p2", 40)
    assert credits_for([aggregate(0, [u1, u2])], {"p1": [u1]}) is None
    # Heard, but another update than the one listed (a restarted producer's first): its samples are unknown too.
    assert credits_for([aggregate(0, [u1])], {"p1": [update("p1", 80, "other")]}) is None


def test_a_receipt_refuses_what_cannot_be_a_contribution():
    for bad in ({"slices": 0}, {"slices": 3}, {"samples": 0}, {"round": -1}, {"weights_hash": "xyz"}, {"producer": ""},
                {"task_id": "short"}):
        with pytest.raises(ValueError):
            Receipt(**{"task_id": TASK, "round": 3, "producer": "p1", "samples": 8, "slices": 1, "num_slices": 2,
                       "weights_hash": WEIGHTS, **bad})
    assert receipt(slices=1).share == 0.5


def test_a_ledger_reads_back_every_receipt_signed_and_skips_a_torn_tail():
    rs = receipts_for(TASK, 3, WEIGHTS, 2, [Credit("p1", 80, 2), Credit("p2", 40, 1)])
    data = b"".join(frame(seal(r, A)) for r in rs)
    read = parse_ledger(data, task_id=TASK)
    assert [s.message for s in read.receipts] == rs and {s.signer for s in read.receipts} == {A.peer_id}
    assert (read.invalid, read.torn) == (0, False)
    torn = parse_ledger(data + frame(seal(receipt("p9"), A))[:-7], task_id=TASK)
    assert [s.message for s in torn.receipts] == rs and torn.torn


def test_a_tampered_or_foreign_receipt_is_counted_invalid_and_the_rest_still_read():
    good = frame(seal(receipt("p1"), A))
    sealed = bytearray(seal(receipt("p2"), A))
    sealed[-1] ^= 1  # the signature no longer verifies
    foreign = frame(seal(Receipt(task_id=OTHER_TASK, round=3, producer="p3", samples=8, slices=1, num_slices=2,
                                 weights_hash=WEIGHTS), A))
    read = parse_ledger(good + frame(bytes(sealed)) + foreign + good, task_id=TASK)
    assert [s.message.producer for s in read.receipts] == ["p1", "p1"] and read.invalid == 2
    # A length beyond any receipt is damage: what came before it still reads.
    damaged = parse_ledger(good + b"\xff\xff\xff\xff" + good, task_id=TASK)
    assert len(damaged.receipts) == 1 and damaged.invalid == 1


def test_the_digest_covers_what_receipts_say_not_who_sealed_them_or_in_which_order():
    rs = [receipt("p1"), receipt("p2", samples=40), receipt("p1", round_index=4)]
    assert digest(rs) == digest(list(reversed(rs)))
    assert digest(rs) != digest([*rs[:2], receipt("p1", round_index=4, samples=81)])
    # A round recorded again (closed again after a restart) counts once, the last one winning.
    assert latest([receipt("p1", samples=1), receipt("p1", samples=80)]) == [receipt("p1", samples=80)]
    assert digest([receipt("p1", samples=1), *rs]) == digest(rs)
