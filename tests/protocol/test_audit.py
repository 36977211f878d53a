"""Proofs of forged aggregates: what a proof must carry to be judged, and who pays when it is wrong."""

import pytest

from protocol.audit import Accused, Audit, FalseAccusation, Forged, Verified, open_proof
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.keys import Keypair
from protocol.task import MAX_PROOF_BYTES, AggregateAnnounce, AggregateProof

TASK = "ab" * 32
H1, H2, H3 = "11" * 32, "22" * 32, "33" * 32
AGGREGATOR = Keypair.from_label("aggregator")
ACCUSER = Keypair.from_label("accuser")


def aggregate(result=H1, task=TASK, aggregator=AGGREGATOR.peer_id) -> AggregateAnnounce:
    return AggregateAnnounce(task_id=task, round=3, slice=1, aggregator=aggregator, included=("p", "q"),
                             inputs=(H2, H3), manifest_id=result, result_hash=result)


def proof(sealed: bytes) -> AggregateProof:
    return AggregateProof(task_id=TASK, accuser=ACCUSER.peer_id, aggregate=sealed, result_hash=H2)


def test_a_proof_carries_the_aggregate_its_aggregator_signed():
    a = aggregate()
    p = proof(seal(a, AGGREGATOR))
    assert decode(encode(p)) == p
    assert open_proof(p, TASK, max_bytes=64 * 1024) == Accused(aggregate=a, accuser=ACCUSER.peer_id)


@pytest.mark.parametrize("sealed, reason", [
    (b"\x00not an envelope", "malformed"),
    (seal(aggregate(), ACCUSER), "impersonation"),  # the accuser signed it, not the aggregator it names
    (seal(aggregate(task="cd" * 32), AGGREGATOR), "impersonation"),  # a real aggregate, of another task
])
def test_a_proof_that_proves_nothing_is_refused_with_a_reason_to_charge(sealed, reason):
    assert open_proof(proof(sealed), TASK, max_bytes=64 * 1024) == reason


def test_a_proof_larger_than_a_task_message_allows_is_not_built():
    with pytest.raises(ValueError, match="sealed envelope"):
        AggregateProof(task_id=TASK, accuser=ACCUSER.peer_id, aggregate=b"x" * (MAX_PROOF_BYTES + 1), result_hash=H2)


def test_a_verdict_bans_the_aggregate_it_contradicts_and_charges_a_wrong_accuser():
    audit = Audit()
    honest, forged = aggregate(H1), aggregate(H3, aggregator="liar")
    assert audit.judge(forged) == []  # nothing recomputed yet: nothing judged
    audit.accuse("honest-accuser", forged)
    audit.accuse("wrong-accuser", honest)
    assert audit.ask(honest, ()) and audit.ask(honest, ()) == []  # one recomputation per key
    waiting = audit.answer(Verified(key=honest.key(), result_hash=H1))
    assert {a for a, _ in waiting} == {"honest-accuser", "wrong-accuser"}
    judged = [e for accuser, a in waiting for e in audit.judge(a, accuser=accuser)]
    assert judged == [Forged(forged, H1, prove=False), FalseAccusation("wrong-accuser", honest)]
    assert audit.banned == {"liar"} and audit.judge(forged) == []  # banned once
    # Inputs that could not be fetched decide nothing.
    other = AggregateAnnounce(task_id=TASK, round=3, slice=0, aggregator="x", included=("p",), inputs=(H2,),
                              manifest_id=H2, result_hash=H2)
    audit.answer(Verified(key=other.key(), result_hash=None))
    assert audit.judge(other) == [] and audit.banned == {"liar"}
    audit.forget_before(4)
    assert not audit.verdicts and audit.banned == {"liar"}


def test_an_aggregate_that_screened_nobody_encodes_as_before_the_screen_claims_existed():
    import msgpack
    a = aggregate()
    assert len(msgpack.unpackb(encode(a))) == 2 + 8  # version, tag, the eight fields it always had
    screened = AggregateAnnounce(task_id=TASK, round=3, slice=1, aggregator=AGGREGATOR.peer_id, included=("p", "q"),
                                 inputs=(H2, H3), manifest_id=H1, result_hash=H1, screened=("r", "z"),
                                 screened_inputs=(H3, H2), screened_why=("opposed", "empty"))
    assert decode(encode(screened)) == screened and screened.accounted() == {"p", "q", "r", "z"}
    assert screened.key() != a.key()  # a screen claim is part of what the result is a function of


@pytest.mark.parametrize("fields, message", [
    ({"screened": ("z", "r"), "screened_inputs": (H2, H3), "screened_why": ("empty", "empty")}, "sorted"),
    ({"screened": ("p",), "screened_inputs": (H2,), "screened_why": ("empty",)}, "none of them included"),
    ({"screened": ("z",), "screened_inputs": (), "screened_why": ("empty",)}, "one hex manifest id"),
    ({"screened": ("z",), "screened_inputs": (H2,), "screened_why": ("lazy",)}, "screened_why"),
])
def test_a_screen_claim_that_does_not_hold_together_is_refused(fields, message):
    import msgpack

    from protocol.errors import RemoteProtocolError
    with pytest.raises(ValueError, match=message):
        AggregateAnnounce(task_id=TASK, round=3, slice=1, aggregator=AGGREGATOR.peer_id, included=("p", "q"),
                          inputs=(H2, H3), manifest_id=H1, result_hash=H1, **fields)
    wire = msgpack.unpackb(encode(aggregate())) + [list(fields["screened"]), list(fields["screened_inputs"]),
                                                     list(fields["screened_why"])]
    with pytest.raises(RemoteProtocolError, match=message):  # as a peer would send it
        decode(msgpack.packb(wire))
