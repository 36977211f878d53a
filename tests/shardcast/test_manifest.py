"""Manifest: id stability, tampering, caps, layout and bitfields."""

import dataclasses
import hashlib

import pytest
from hypothesis import given, settings, strategies as st

from protocol.codec import decode, encode
from protocol.errors import DecodeError, IntegrityError, LocalProtocolError, SignatureError
from protocol.keys import Keypair
from protocol.manifest import (MAX_HAVES_PER_MESSAGE, MAX_SHARDS, Have, Haves, ShardHeader, TensorEntry, bitfield_from_indices,
                               bitfield_indices, build_manifest, layout_tensors, make_manifest, manifest_id,
                               open_manifest, seal_manifest)

KEY = Keypair.from_label("publisher")
DATA = bytes(range(256)) * 40  # 10,240 bytes


def test_id_is_stable_and_content_addressed():
    a = build_manifest(DATA, shard_bytes=1024, label="w", version=3)
    b = build_manifest(bytearray(DATA), shard_bytes=1024, label="w", version=3)
    assert manifest_id(a) == manifest_id(b)
    assert a.num_shards == 10 and a.shard_hashes[0] == hashlib.sha256(DATA[:1024]).digest()
    assert decode(encode(a)) == a
    other = build_manifest(DATA, shard_bytes=1024, label="w", version=4)
    assert manifest_id(other) != manifest_id(a) and other.content_id == a.content_id


def test_last_shard_is_short():
    m = build_manifest(DATA[:2500], shard_bytes=1024)
    assert [m.shard_size(i) for i in range(m.num_shards)] == [1024, 1024, 452]
    with pytest.raises(IndexError):
        m.shard_range(3)


def test_tampered_manifest_changes_id_and_breaks_signature():
    m = build_manifest(DATA, shard_bytes=1024)
    signed = seal_manifest(m, KEY)
    assert open_manifest(signed.sealed, expected_id=signed.manifest_id).signer == KEY.peer_id
    env = decode(signed.sealed)
    forged = dataclasses.replace(m, label="evil")
    assert manifest_id(forged) != signed.manifest_id
    with pytest.raises(SignatureError):
        open_manifest(encode(dataclasses.replace(env, payload=encode(forged))))
    resealed = seal_manifest(forged, Keypair.from_label("mallory"))
    with pytest.raises(IntegrityError):
        open_manifest(resealed.sealed, expected_id=signed.manifest_id)


def test_swapped_shard_hash_is_refused_by_content_id():
    m = build_manifest(DATA, shard_bytes=1024)
    hashes = list(m.shard_hashes)
    hashes[2] = hashlib.sha256(b"other").digest()
    with pytest.raises(ValueError, match="content_id"):
        dataclasses.replace(m, shard_hashes=tuple(hashes))
    wire = encode(m).replace(m.shard_hashes[2], hashes[2])
    with pytest.raises(DecodeError):
        decode(wire)


def test_caps_and_consistency():
    with pytest.raises(LocalProtocolError):
        build_manifest(DATA, shard_bytes=100)  # below MIN_SHARD_BYTES
    with pytest.raises(LocalProtocolError):
        make_manifest(kind="file", label="", version=0, total_bytes=(MAX_SHARDS + 1) * 1024, shard_bytes=1024,
                      shard_hashes=[b"\0" * 32] * (MAX_SHARDS + 1))
    with pytest.raises(LocalProtocolError, match="hashes"):
        make_manifest(kind="file", label="", version=0, total_bytes=4096, shard_bytes=1024, shard_hashes=[b"\0" * 32])
    with pytest.raises(ValueError):
        TensorEntry(name="w", dtype="complex64", shape=(2,), offset=0, nbytes=16)
    with pytest.raises(ValueError, match="nbytes"):
        TensorEntry(name="w", dtype="float32", shape=(2, 3), offset=0, nbytes=23)
    with pytest.raises(ValueError):
        ShardHeader(manifest_id=b"\0" * 32, index=0, status="ok", nbytes=1 << 40, sha256=b"\0" * 32)


def test_tensor_layout_is_aligned_and_checked():
    entries, total = layout_tensors([("a", "float32", (3,)), ("b", "bfloat16", (2, 2)), ("c", "bool", ())])
    assert [e.offset for e in entries] == [0, 64, 128] and total == 129
    m = build_manifest(bytes(total), shard_bytes=1024, kind="tensors", tensors=entries)
    assert m.tensors == entries
    overlapping = (entries[0], dataclasses.replace(entries[1], offset=0))
    with pytest.raises(LocalProtocolError):
        build_manifest(bytes(total), shard_bytes=1024, kind="tensors", tensors=overlapping)
    with pytest.raises(LocalProtocolError, match="past total_bytes"):
        build_manifest(bytes(100), shard_bytes=1024, kind="tensors", tensors=entries)


def test_have_bitfield_length_is_checked():
    with pytest.raises(ValueError):
        Have(manifest_id=b"\0" * 32, num_shards=9, bitfield=b"\xff")


def test_haves_round_trip_and_refuse_empty_oversized_or_repeated_batches():
    haves = tuple(Have(manifest_id=bytes([i]) * 32, num_shards=9, bitfield=b"\xff\x01") for i in range(3))
    assert decode(encode(Haves(haves=haves))) == Haves(haves=haves)
    many = tuple(Have(manifest_id=bytes([i]) * 32, num_shards=1, bitfield=b"\x01")
                 for i in range(MAX_HAVES_PER_MESSAGE + 1))
    for bad in ((), many, (haves[0], haves[0])):
        with pytest.raises(ValueError):
            Haves(haves=bad)
    # From the network the same refusals are the peer's fault, never a crash.
    wire = encode(Haves(haves=haves[:2])).replace(haves[1].manifest_id, haves[0].manifest_id)
    with pytest.raises(DecodeError):
        decode(wire)


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=300), st.data())
def test_bitfield_round_trip(num_shards, data):
    indices = data.draw(st.sets(st.integers(min_value=0, max_value=max(0, num_shards - 1)), max_size=num_shards))
    indices = {i for i in indices if i < num_shards}
    assert bitfield_indices(bitfield_from_indices(num_shards, indices), num_shards) == indices


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_garbage_never_crashes_the_decoder(blob):
    try:
        open_manifest(blob)
    except (DecodeError, SignatureError, IntegrityError):
        pass
    except Exception as exc:  # anything else would crash a gossip consumer
        pytest.fail(f"{type(exc).__name__}: {exc}")
