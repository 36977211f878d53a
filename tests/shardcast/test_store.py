"""Store: atomic content-addressed writes, resume with re-verification, GC of old versions."""

import hashlib
import os

import pytest

from protocol.errors import IntegrityError
from protocol.keys import Keypair
from protocol.manifest import build_manifest, seal_manifest

from node.shardcast.store import ShardStore

KEY = Keypair.from_label("publisher")


def _publish(store, data, version, shard_bytes=1024):
    m = build_manifest(data, shard_bytes=shard_bytes, version=version, label=f"v{version}")
    for i in range(m.num_shards):
        start, end = m.shard_range(i)
        store.put_shard(data[start:end])
    signed = seal_manifest(m, KEY)
    store.put_manifest(signed)
    return signed


def test_put_and_read_shard_is_content_addressed(tmp_path):
    store = ShardStore.open(tmp_path)
    digest = store.put_shard(b"hello" * 300)
    assert digest == hashlib.sha256(b"hello" * 300).digest()
    assert store.put_shard(b"hello" * 300) == digest  # idempotent
    assert store.read_shard(digest) == b"hello" * 300
    assert store.shard_path(digest).parent.parent == tmp_path / "shards"
    assert list((tmp_path / "tmp").iterdir()) == []


def test_writer_rejects_wrong_bytes_and_leaves_nothing(tmp_path):
    store = ShardStore.open(tmp_path)
    good = b"x" * 2000
    sha = hashlib.sha256(good).digest()
    w = store.shard_writer(sha, len(good))
    w.write(b"y" * 2000)
    with pytest.raises(IntegrityError):
        w.commit()
    w.abort()
    with pytest.raises(IntegrityError):
        store.shard_writer(sha, len(good)).write(b"x" * 2001)
    assert not store.has_shard(sha) and not store.shard_path(sha).exists()
    w = store.shard_writer(sha, len(good))
    w.write(good[:1000])
    w.write_all([good[1000:1500], memoryview(good)[1500:]])
    w.commit()
    assert store.has_shard(sha) and store.read_shard(sha) == good
    # A writer that never got a byte: nothing on disk to abort, and an empty shard commits.
    store.shard_writer(sha, len(good)).abort()
    empty = hashlib.sha256(b"").digest()
    store.shard_writer(empty, 0).commit()
    assert store.read_shard(empty) == b"" and list((tmp_path / "tmp").iterdir()) == []


def test_resume_reverifies_and_drops_corrupt_shards(tmp_path):
    store = ShardStore.open(tmp_path)
    data = os.urandom(5000)
    signed = _publish(store, data, 1)
    (tmp_path / "tmp" / "leftover.part").write_bytes(b"partial")
    victim = signed.manifest.shard_hashes[1]
    path = store.shard_path(victim)
    old = path.read_bytes()
    path.write_bytes(bytes([old[0] ^ 1]) + old[1:])  # a flipped bit: a written 0 may be the byte already there

    reopened = ShardStore.open(tmp_path)
    report = reopened.last_open_report
    assert report.shards_corrupt == 1 and report.shards_kept == 4 and report.manifests_kept == 1
    assert reopened.held_indices(signed.manifest_id) == {0, 2, 3, 4}
    assert reopened.get_manifest(signed.manifest_id).manifest == signed.manifest
    assert list((tmp_path / "tmp").iterdir()) == []


def test_read_shard_detects_corruption_after_load(tmp_path):
    store = ShardStore.open(tmp_path)
    digest = store.put_shard(b"a" * 1500)
    store.shard_path(digest).write_bytes(b"b" * 1500)
    with pytest.raises(IntegrityError):
        store.read_shard(digest)
    assert not store.has_shard(digest)


def test_invalid_manifest_file_is_dropped(tmp_path):
    store = ShardStore.open(tmp_path)
    signed = _publish(store, os.urandom(3000), 1)
    path = tmp_path / "manifests" / f"{signed.manifest_id.hex()}.sealed"
    assert ShardStore.open(tmp_path).last_open_report.manifests_invalid == 0
    sealed = path.read_bytes()
    # Flip every bit of the signature's last byte: writing a fixed value is a no-op when the byte already has it.
    path.write_bytes(sealed[:-1] + bytes([sealed[-1] ^ 0xFF]))
    reopened = ShardStore.open(tmp_path)
    assert reopened.last_open_report.manifests_invalid == 1 and reopened.last_open_report.manifests_kept == 0
    assert reopened.get_manifest(signed.manifest_id) is None and not path.exists()


def test_gc_keeps_last_k_and_shared_shards(tmp_path):
    store = ShardStore.open(tmp_path)
    shared = os.urandom(1024)
    versions = []
    for v in range(5):
        versions.append(_publish(store, shared + os.urandom(2048), v))
        mtime = 1_000_000_000 + v
        os.utime(tmp_path / "manifests" / f"{versions[-1].manifest_id.hex()}.sealed", ns=(mtime, mtime))
    protected = versions[0].manifest_id
    removed_manifests, removed_shards = store.gc(keep_manifests=2, protect={protected})
    assert removed_manifests == 2 and removed_shards == 4
    assert set(store.manifest_ids()) == {protected, versions[3].manifest_id, versions[4].manifest_id}
    for s in (versions[0], versions[3], versions[4]):
        assert store.held_indices(s.manifest_id) == set(range(s.manifest.num_shards))
    assert store.has_shard(hashlib.sha256(shared).digest())
    for s in (versions[1], versions[2]):
        assert not store.has_shard(s.manifest.shard_hashes[1])
    assert ShardStore.open(tmp_path).num_shards() == store.num_shards()


def test_manifests_keep_their_age_order_when_refreshed_and_across_a_restart(tmp_path):
    """GC drops the oldest first: a manifest stored again counts as new, and a reopened store orders them alike."""
    store = ShardStore.open(tmp_path)
    signed = [_publish(store, os.urandom(1500), v) for v in range(4)]
    store.put_manifest(signed[0])  # refreshed: now the newest
    expected = [s.manifest_id for s in (*signed[1:], signed[0])]
    assert store.manifest_ids() == expected
    assert ShardStore.open(tmp_path).manifest_ids() == expected
    assert store.gc(keep_manifests=2) == (2, 4)  # two manifests of two shards each
    assert store.manifest_ids() == expected[2:]
