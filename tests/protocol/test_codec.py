"""Codec: round trips, strict rejection, and fuzzing that only ever raises the protocol's own errors."""

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from protocol import PROTOCOL_VERSION
from protocol.codec import decode, encode
from protocol.envelope import Envelope, open_sealed, seal
from protocol.errors import DecodeError, OversizeError, RemoteProtocolError, SignatureError
from protocol.keys import Keypair
from protocol.messages import Announce, HardwareSummary

KEY = Keypair.from_label("codec")


def announce(**overrides):
    fields = dict(peer_id=KEY.peer_id, seq=7, addrs=("/ip4/127.0.0.1/tcp/4001",), version="0.1.0",
                  roles=("trainer",), hardware=HardwareSummary(devices=("cpu",), memory_bytes=1 << 30, tflops=0.5))
    fields.update(overrides)
    return Announce(**fields)


def test_round_trip_keeps_every_field():
    msg = announce(control="task abc round 3")
    assert decode(encode(msg)) == msg


def test_sealed_round_trip_names_the_signer():
    signed = open_sealed(seal(announce(), KEY), expect=Announce)
    assert signed.signer == KEY.peer_id
    assert signed.message == announce()


def test_unknown_version_is_refused():
    raw = msgpack.unpackb(encode(announce()))
    raw[0] = PROTOCOL_VERSION + 1
    with pytest.raises(DecodeError, match="version"):
        decode(msgpack.packb(raw))


def test_unknown_tag_is_refused():
    with pytest.raises(DecodeError, match="unknown message tag"):
        decode(msgpack.packb([PROTOCOL_VERSION, 9999, 1, 2]))


def test_wrong_field_type_is_refused():
    raw = msgpack.unpackb(encode(announce()))
    raw[3] = "seven"  # seq
    with pytest.raises(DecodeError, match="seq"):
        decode(msgpack.packb(raw))


def test_invariant_violation_from_the_wire_is_a_decode_error():
    raw = msgpack.unpackb(encode(announce()))
    raw[6] = ["emperor"]  # roles
    with pytest.raises(DecodeError, match="roles"):
        decode(msgpack.packb(raw))


def test_oversize_is_refused_before_parsing():
    data = encode(announce())
    with pytest.raises(OversizeError):
        decode(data, max_bytes=len(data) - 1)


def test_unexpected_type_is_refused():
    with pytest.raises(DecodeError, match="unexpected"):
        decode(encode(announce()), expect=Envelope)


def test_tampered_payload_fails_the_signature():
    env = decode(seal(announce(), KEY))
    forged = Envelope(signer=env.signer, payload=encode(announce(seq=8)), signature=env.signature)
    with pytest.raises(SignatureError):
        open_sealed(encode(forged))


def test_signature_by_another_key_names_that_key():
    other = Keypair.from_label("other")
    signed = open_sealed(seal(announce(), other))
    assert signed.signer == other.peer_id != signed.message.peer_id


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_raise_only_protocol_errors(data):
    try:
        open_sealed(data)
    except RemoteProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_frames_raise_only_protocol_errors(data):
    frame = bytearray(seal(announce(), KEY))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    try:
        open_sealed(bytes(frame[:cut]))
    except RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text() | st.binary(),
                    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(), inner, max_size=4),
                    max_leaves=30))
def test_arbitrary_msgpack_values_raise_only_protocol_errors(value):
    for prefix in ([], [PROTOCOL_VERSION], [PROTOCOL_VERSION, 3]):
        payload = prefix + value if isinstance(value, list) else [*prefix, value]
        try:
            decode(msgpack.packb(payload, use_bin_type=True))
        except RemoteProtocolError:
            pass
