"""Content-addressed shard store on disk: shards by sha256, sealed manifests by id, atomic writes, GC."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from node.fsutil import fsync_dir, write_atomic
from protocol.errors import IntegrityError, RemoteProtocolError
from protocol.manifest import SignedManifest, open_manifest

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class OpenReport:
    """What ShardStore.open found: shards kept after re-hashing, corrupt ones removed, manifests."""

    shards_kept: int
    shards_corrupt: int
    manifests_kept: int
    manifests_invalid: int


class ShardWriter:
    """Receives one shard chunk by chunk, hashing as it goes; commit() verifies and renames it into the store."""

    def __init__(self, store: "ShardStore", sha256: bytes, nbytes: int):
        self._store = store
        self.sha256 = sha256
        self.nbytes = nbytes
        self.received_bytes = 0
        self._hash = hashlib.sha256()
        self._tmp = store.tmp_dir / f"{sha256.hex()}.{id(self):x}.part"
        self._file = None
        """Opened by the first write (blocking: in the caller's worker thread, not on the event loop)."""

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        self.write_all((chunk,))

    def write_all(self, chunks) -> None:
        """Several chunks in order, as write() each (the receiver hands over what it read, uncopied)."""
        if self.received_bytes + sum(len(c) for c in chunks) > self.nbytes:
            raise IntegrityError(f"shard longer than the promised {self.nbytes} bytes")
        file = self._opened()
        for chunk in chunks:
            self._hash.update(chunk)
            file.write(chunk)
            self.received_bytes += len(chunk)

    def _opened(self):
        if self._file is None:
            self._file = open(self._tmp, "wb")
        return self._file

    def verify(self) -> None:
        """IntegrityError unless the bytes so far are exactly the promised shard."""
        if self.received_bytes != self.nbytes:
            raise IntegrityError(f"shard has {self.received_bytes} bytes, expected {self.nbytes}")
        if self._hash.digest() != self.sha256:
            raise IntegrityError("shard hash mismatch")

    def commit(self) -> None:
        """Blocking (file system calls): run it in a thread.

        Not fsynced: a fetched shard can be fetched again, and open() re-hashes every shard, so one that a crash
        tore is dropped, never served. An fsync per shard cost a tenth of a receiver's goodput on loopback."""
        self.verify()
        file = self._opened()  # opened here if the shard is empty
        file.close()
        self._store._install(self._tmp, self.sha256, self.nbytes)

    def abort(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class HeldShard:
    """A shard served from memory (ShardStore.hold_in_memory): its bytes as consecutive pieces, and ``keep``, the
    object that owns the memory they view. Whoever reads the pieces holds this, so the memory outlives the read
    even if the store lets the shard go meanwhile."""

    pieces: tuple
    nbytes: int
    keep: object = None

    def copy_into(self, out: memoryview) -> None:
        at = 0
        for piece in self.pieces:
            out[at:at + len(piece)] = piece
            at += len(piece)


class ShardStore:
    """A data dir: ``shards/<aa>/<sha256 hex>``, ``manifests/<id hex>.sealed``, ``tmp/``, and shards held in memory.

    Blocking methods (open, put_*, read_shard, gc) belong in ``trio.to_thread.run_sync``.
    Recency of manifests is the file's mtime, refreshed each time it is stored again.
    """

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.shard_dir = self.data_dir / "shards"
        self.manifest_dir = self.data_dir / "manifests"
        self.tmp_dir = self.data_dir / "tmp"
        for d in (self.shard_dir, self.manifest_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._shards: dict[bytes, int] = {}
        self._in_memory: dict[bytes, HeldShard] = {}
        """Shards served from memory this process holds and never changes (hold_in_memory): never on disk, so
        gone with the process, and their manifests are never written either."""
        self._manifests: dict[bytes, SignedManifest] = {}
        self._touched: dict[bytes, int] = {}
        """Per manifest, when it was last stored or refreshed (ns, the clock file mtimes use): its file's mtime
        when the store opened, kept in memory since, so ordering manifests costs no stat() per manifest."""
        self.last_open_report: OpenReport | None = None

    @classmethod
    def open(cls, data_dir: Path | str) -> "ShardStore":
        """Load a data dir, re-hashing every shard and dropping corrupt ones and leftovers."""
        store = cls(Path(data_dir))
        store.last_open_report = store._load()
        return store

    def _load(self) -> OpenReport:
        for leftover in self.tmp_dir.iterdir():
            leftover.unlink(missing_ok=True)
        kept = corrupt = 0
        for sub in self.shard_dir.iterdir():
            for path in sub.iterdir() if sub.is_dir() else ():
                try:
                    digest = bytes.fromhex(path.name)
                except ValueError:
                    digest = b""
                actual, nbytes = self.hash_file(path)
                if actual != digest:
                    log.warning("dropping corrupt shard %s", path.name)
                    path.unlink(missing_ok=True)
                    corrupt += 1
                    continue
                self._shards[digest] = nbytes
                kept += 1
        good = bad = 0
        for path in self.manifest_dir.glob("*.sealed"):
            try:
                signed = open_manifest(path.read_bytes(), expected_id=bytes.fromhex(path.stem))
            except (RemoteProtocolError, ValueError):
                log.warning("dropping invalid manifest %s", path.name)
                path.unlink(missing_ok=True)
                bad += 1
                continue
            self._manifests[signed.manifest_id] = signed
            self._touched[signed.manifest_id] = path.stat().st_mtime_ns
            good += 1
        return OpenReport(shards_kept=kept, shards_corrupt=corrupt, manifests_kept=good, manifests_invalid=bad)

    @staticmethod
    def hash_file(path: Path) -> tuple[bytes, int]:
        """(sha256, size) of a file, read in bounded chunks (blocking)."""
        h = hashlib.sha256()
        nbytes = 0
        with open(path, "rb") as f:
            while chunk := f.read(READ_CHUNK_BYTES):
                h.update(chunk)
                nbytes += len(chunk)
        return h.digest(), nbytes

    # shards

    def shard_path(self, sha256: bytes) -> Path:
        name = sha256.hex()
        return self.shard_dir / name[:2] / name

    def has_shard(self, sha256: bytes) -> bool:
        return sha256 in self._shards or sha256 in self._in_memory

    def shard_bytes_on_disk(self) -> int:
        return sum(self._shards.values())

    def shard_bytes_in_memory(self) -> int:
        return sum(h.nbytes for sha, h in list(self._in_memory.items()) if sha not in self._shards)

    def num_shards(self) -> int:
        return len(self._shards.keys() | self._in_memory.keys())

    def hold_in_memory(self, pieces: list, sha256: bytes, *, keep: object) -> None:
        """Serve the concatenated ``pieces`` as the shard ``sha256`` (which the caller just computed of them) from
        memory, without writing them: for bytes this node holds anyway and never changes in place, such as the
        state it publishes each round (a copy on disk would be one more model-sized write and file per round).
        ``keep`` owns the memory the pieces view; the store holds it until the shard is collected."""
        held = HeldShard(pieces=tuple(pieces), nbytes=sum(len(p) for p in pieces), keep=keep)
        with self._lock:
            self._in_memory.setdefault(sha256, held)

    def held_in_memory(self, sha256: bytes) -> HeldShard | None:
        return self._in_memory.get(sha256)

    def _install(self, tmp: Path, sha256: bytes, nbytes: int) -> None:
        path = self.shard_path(sha256)
        path.parent.mkdir(exist_ok=True)
        with self._lock:
            os.replace(tmp, path)
            self._shards[sha256] = nbytes

    def put_shard(self, data: bytes | bytearray | memoryview, *, sha256: bytes | None = None,
                  durable: bool = True) -> bytes:
        """Store ``data`` under its sha256 (a no-op if present); returns the hash.

        ``sha256``: the hash the caller just computed of these very bytes (its own manifest), not hashed again.
        ``durable=False``: no fsync, for bytes this node can make or fetch again; open() re-hashes every shard,
        so one a crash tore is dropped, never served."""
        digest = hashlib.sha256(data).digest() if sha256 is None else sha256
        if digest not in self._shards:
            path = self.shard_path(digest)
            path.parent.mkdir(exist_ok=True)
            if durable:
                write_atomic(path, data, tmp_dir=self.tmp_dir)
            else:
                tmp = self.tmp_dir / f"{digest.hex()}.{threading.get_ident()}.put"
                tmp.write_bytes(data)
                os.replace(tmp, path)
            with self._lock:
                self._shards[digest] = len(data)
        return digest

    def put_shard_pieces(self, pieces: list, sha256: bytes, *, durable: bool = True) -> None:
        """put_shard of the concatenated ``pieces``, whose sha256 the caller just computed, written piece by piece."""
        if sha256 in self._shards:
            return
        path = self.shard_path(sha256)
        path.parent.mkdir(exist_ok=True)
        tmp = self.tmp_dir / f"{sha256.hex()}.{threading.get_ident()}.put"
        try:
            with open(tmp, "wb") as f:
                nbytes = sum(f.write(p) for p in pieces)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        if durable:
            fsync_dir(path.parent)
        with self._lock:
            self._shards[sha256] = nbytes

    def shard_writer(self, sha256: bytes, nbytes: int) -> ShardWriter:
        return ShardWriter(self, sha256, nbytes)

    def read_shard_into(self, sha256: bytes, out: memoryview, *, verify: bool = True) -> None:
        """read_shard into ``out`` (exactly the shard's size), without an intermediate copy."""
        held = self._in_memory.get(sha256)
        if held is not None and held.nbytes == len(out):
            held.copy_into(out)  # memory this process never changed since it hashed it: nothing to verify
            return
        with open(self.shard_path(sha256), "rb") as f:
            got = f.readinto(out)
        if got != len(out) or (verify and hashlib.sha256(out).digest() != sha256):
            self.drop_shard(sha256)
            raise IntegrityError(f"shard {sha256.hex()[:16]} is corrupt on disk; dropped")

    def read_shard(self, sha256: bytes, *, verify: bool = True) -> bytes:
        """The shard's bytes; IntegrityError (and the file dropped) if the disk no longer matches."""
        held = self._in_memory.get(sha256)
        if held is not None:
            return b"".join(held.pieces)
        data = self.shard_path(sha256).read_bytes()
        if verify and hashlib.sha256(data).digest() != sha256:
            self.drop_shard(sha256)
            raise IntegrityError(f"shard {sha256.hex()[:16]} is corrupt on disk; dropped")
        return data

    def drop_shard(self, sha256: bytes) -> None:
        with self._lock:
            self._shards.pop(sha256, None)
            self._in_memory.pop(sha256, None)
            self.shard_path(sha256).unlink(missing_ok=True)

    # manifests

    def put_manifest(self, signed: SignedManifest, *, persist: bool = True) -> None:
        """Store (or refresh the recency of) a verified manifest; another signer's copy of it (the same id and
        shards) replaces the one held, on disk too. ``persist=False``: in memory only, for a manifest of shards
        held in memory (a restart finds neither)."""
        path = self.manifest_dir / f"{signed.manifest_id.hex()}.sealed"
        held = self._manifests.get(signed.manifest_id)
        now = time.time_ns()
        if persist:
            if path.exists() and (held is None or held.signer == signed.signer):
                os.utime(path, ns=(now, now))
            else:
                write_atomic(path, signed.sealed, tmp_dir=self.tmp_dir)
        with self._lock:
            self._touched[signed.manifest_id] = now  # first: a lock-free reader never sees a manifest untimed
            self._manifests[signed.manifest_id] = signed

    def get_manifest(self, manifest_id: bytes) -> SignedManifest | None:
        return self._manifests.get(manifest_id)

    def manifest_ids(self) -> list[bytes]:
        """Stored manifests, oldest first (by when each was last stored or refreshed). Takes no lock (the event
        loop calls it): it sorts copies, which a GC in another thread cannot change while we sort."""
        return self._oldest_first(dict(self._manifests), dict(self._touched))

    @staticmethod
    def _oldest_first(manifests: dict[bytes, SignedManifest], touched: dict[bytes, int]) -> list[bytes]:
        # Times can tie (mtimes read at open have the filesystem's granularity); the version breaks such ties.
        key = {mid: (touched.get(mid, 0), s.manifest.version, mid) for mid, s in manifests.items()}
        return sorted(key, key=key.__getitem__)

    def held_indices(self, manifest_id: bytes) -> set[int]:
        signed = self._manifests.get(manifest_id)
        if signed is None:
            return set()
        return {i for i, h in enumerate(signed.manifest.shard_hashes) if self.has_shard(h)}

    def gc(self, *, keep_manifests: int, protect: set[bytes] = frozenset(),
           drop: set[bytes] = frozenset()) -> tuple[int, int]:
        """Keep the newest ``keep_manifests`` manifests plus ``protect``, less ``drop`` (unless protected);
        delete shards nobody references.

        Returns (manifests removed, shards removed).
        """
        with self._lock:
            order = self._oldest_first(self._manifests, self._touched)
            doomed = [m for m in order[:max(0, len(order) - keep_manifests)] if m not in protect]
            doomed += [m for m in drop if m in self._manifests and m not in protect and m not in doomed]
            for mid in doomed:
                self._manifests.pop(mid)
                self._touched.pop(mid, None)
                (self.manifest_dir / f"{mid.hex()}.sealed").unlink(missing_ok=True)
            referenced = {h for s in self._manifests.values() for h in s.manifest.shard_hashes}
            orphans = [h for h in self._shards if h not in referenced]
            for h in orphans:
                self._shards.pop(h)
                self.shard_path(h).unlink(missing_ok=True)
            gone = [h for h in self._in_memory if h not in referenced]
            for h in gone:
                del self._in_memory[h]
        return len(doomed), len(set(orphans) | set(gone))
