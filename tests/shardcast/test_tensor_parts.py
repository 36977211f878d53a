"""Publishing tensors without a blob copy gives tensors_to_blob's bytes; release drops a manifest and its shards."""

from __future__ import annotations

import pytest
import torch

from node.shardcast.store import ShardStore
from node.shardcast.tensors import TensorParts, tensors_to_blob
from protocol.keys import Keypair
from protocol.manifest import KIND_TENSORS, build_manifest, seal_manifest

pytestmark = pytest.mark.timeout(30)


def test_parts_are_the_blob_piece_by_piece():
    tensors = {"a": torch.randn(1000), "b": torch.arange(7, dtype=torch.int8), "c": torch.randn(3, 5).double(),
               "empty": torch.zeros(0), "f": torch.randn(33)}
    blob, entries = tensors_to_blob(tensors)
    parts = TensorParts(tensors)
    assert parts.entries == entries and parts.total_bytes == len(blob)
    for start in (0, 1, 100, 4000, 4003, 4100):
        for end in (start, start + 1, start + 64, len(blob)):
            if start <= end <= len(blob):
                assert b"".join(bytes(p) for p in parts.pieces(start, end)) == bytes(blob[start:end])


def _parts_blob_manifest():
    """Two tensors as parts, the blob they stand for, and its manifest in 1 KiB shards."""
    parts = TensorParts({"w": torch.randn(700), "i": torch.arange(5, dtype=torch.int8)})
    blob, _ = tensors_to_blob({"w": parts._keep[0], "i": parts._keep[1]})
    m = build_manifest(blob, shard_bytes=1024, kind=KIND_TENSORS, tensors=parts.entries)
    return parts, blob, m


def test_pieces_stored_under_their_hash_read_back_whole(tmp_path):
    store = ShardStore.open(tmp_path)
    parts, blob, m = _parts_blob_manifest()
    for i, sha in enumerate(m.shard_hashes):
        store.put_shard_pieces(parts.pieces(*m.shard_range(i)), sha, durable=i % 2 == 0)
    assert b"".join(store.read_shard(h) for h in m.shard_hashes) == bytes(blob)
    # A second store on the same directory re-hashes everything and keeps it all.
    assert ShardStore.open(tmp_path).last_open_report.shards_corrupt == 0


def test_gc_drop_releases_a_manifest_and_only_its_own_shards(tmp_path):
    store = ShardStore.open(tmp_path)
    key = Keypair.from_label("release")
    shared = bytes(range(256)) * 4
    made = []
    for n in range(2):
        data = shared + bytes([n]) * 1024
        m = build_manifest(data, shard_bytes=1024, label=f"m{n}", version=n)
        for i in range(m.num_shards):
            store.put_shard(data[slice(*m.shard_range(i))])
        signed = seal_manifest(m, key)
        store.put_manifest(signed)
        made.append(signed)
    removed = store.gc(keep_manifests=256, drop={made[0].manifest_id})
    assert removed == (1, 1)  # the shared first shard stays: the other manifest still references it
    assert store.get_manifest(made[0].manifest_id) is None and store.get_manifest(made[1].manifest_id) is not None
    assert store.num_shards() == 2
    # A protected manifest (a fetch under way) is never dropped.
    assert store.gc(keep_manifests=256, drop={made[1].manifest_id}, protect={made[1].manifest_id}) == (0, 0)


def test_shards_held_in_memory_are_served_and_collected_but_never_written(tmp_path):
    store = ShardStore.open(tmp_path)
    parts, blob, m = _parts_blob_manifest()
    for i, sha in enumerate(m.shard_hashes):
        store.hold_in_memory(parts.pieces(*m.shard_range(i)), sha, keep=parts)
    signed = seal_manifest(m, Keypair.from_label("memory"))
    store.put_manifest(signed, persist=False)
    del parts  # the store keeps the tensors it serves alive
    assert b"".join(store.read_shard(h) for h in m.shard_hashes) == bytes(blob)
    out = bytearray(m.shard_size(1))
    store.read_shard_into(m.shard_hashes[1], memoryview(out))
    assert bytes(out) == bytes(blob[slice(*m.shard_range(1))])
    assert store.held_indices(signed.manifest_id) == set(range(m.num_shards))
    assert store.shard_bytes_on_disk() == 0 and store.shard_bytes_in_memory() == len(blob)
    assert not any((tmp_path / "shards").rglob("*")) and not any((tmp_path / "manifests").iterdir())
    assert ShardStore.open(tmp_path).num_shards() == 0  # a restart finds nothing of it
    assert store.gc(keep_manifests=256, drop={signed.manifest_id}) == (1, m.num_shards)
    assert store.num_shards() == 0 and not store.has_shard(m.shard_hashes[0])
