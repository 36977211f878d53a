"""Shard manifests and the SHARDCAST wire messages: content layout, shard hashes, availability bitfields."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from protocol.codec import encode, message
from protocol.envelope import open_sealed, seal
from protocol.errors import IntegrityError, LocalProtocolError
from protocol.keys import Keypair

MAX_SHARDS = 4096
MAX_TENSORS = 4096
MAX_NAME_CHARS = 256
MAX_LABEL_CHARS = 256
MAX_TENSOR_DIMS = 8
MIN_SHARD_BYTES = 1024
MAX_SHARD_BYTES = 256 * 1024 * 1024
DEFAULT_SHARD_BYTES = 32 * 1024 * 1024
MAX_MANIFEST_BYTES = 200 * 1024
"""A sealed manifest must fit one gossip message (the codec's 256 KiB cap) with room for the envelope."""
TENSOR_ALIGN_BYTES = 64
"""Tensors start on 64-byte boundaries so torch.frombuffer views are aligned for every dtype."""
HASH_BYTES = 32

KIND_TENSORS = "tensors"
KIND_FILE = "file"
KINDS = (KIND_TENSORS, KIND_FILE)

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""The dtypes a manifest may name, with their item size; anything else is refused."""

STATUS_OK = "ok"
STATUS_MISSING = "missing"
STATUS_BUSY = "busy"
STATUS_SEEDED = "seeded"
"""A seeding publisher already sent this shard into the swarm: fetch it from a peer that announces it."""
SHARD_STATUSES = (STATUS_OK, STATUS_MISSING, STATUS_BUSY, STATUS_SEEDED)

_CONTENT_DOMAIN = b"shoal/content/v1\0"


def _check_hash(value: bytes, what: str) -> None:
    if len(value) != HASH_BYTES:
        raise ValueError(f"{what} must be a {HASH_BYTES}-byte sha256")


@message(tag=40)
@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_NAME_CHARS:
            raise ValueError(f"tensor name must have 1..{MAX_NAME_CHARS} characters")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if len(self.shape) > MAX_TENSOR_DIMS or any(d < 0 for d in self.shape):
            raise ValueError(f"shape {self.shape} must have at most {MAX_TENSOR_DIMS} non-negative dims")
        if self.offset < 0 or self.offset % TENSOR_ALIGN_BYTES:
            raise ValueError(f"tensor offset must be a non-negative multiple of {TENSOR_ALIGN_BYTES}")
        if self.nbytes != math.prod(self.shape) * DTYPE_BYTES[self.dtype]:
            raise ValueError(f"tensor {self.name!r}: nbytes {self.nbytes} does not match shape and dtype")


@message(tag=41)
@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A content description: fixed-size shards of one byte string, and optionally its tensors.

    Shard i covers bytes [i * shard_bytes, min((i + 1) * shard_bytes, total_bytes)).
    content_id commits to the whole content (sizes and every shard hash), so two manifests
    of the same bytes share it even when their labels or versions differ.
    """

    kind: str
    label: str
    version: int
    total_bytes: int
    shard_bytes: int
    shard_hashes: tuple[bytes, ...]
    content_id: bytes
    tensors: tuple[TensorEntry, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        if len(self.label) > MAX_LABEL_CHARS:
            raise ValueError(f"label longer than {MAX_LABEL_CHARS} characters")
        if self.version < 0:
            raise ValueError("version must be non-negative")
        if not MIN_SHARD_BYTES <= self.shard_bytes <= MAX_SHARD_BYTES:
            raise ValueError(f"shard_bytes must be within {MIN_SHARD_BYTES}..{MAX_SHARD_BYTES}")
        if self.total_bytes < 0:
            raise ValueError("total_bytes must be non-negative")
        num_shards = -(-self.total_bytes // self.shard_bytes)
        if num_shards > MAX_SHARDS:
            raise ValueError(f"{num_shards} shards exceed the cap of {MAX_SHARDS}")
        if len(self.shard_hashes) != num_shards:
            raise ValueError(f"{self.total_bytes} bytes in {self.shard_bytes}-byte shards need "
                             f"{num_shards} hashes, got {len(self.shard_hashes)}")
        for h in self.shard_hashes:
            _check_hash(h, "shard hash")
        if self.content_id != content_id(self.total_bytes, self.shard_bytes, self.shard_hashes):
            raise ValueError("content_id does not match the shard hashes")
        self._check_tensors()

    def _check_tensors(self) -> None:
        if self.kind == KIND_FILE and self.tensors:
            raise ValueError("a file manifest has no tensors")
        if len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"{len(self.tensors)} tensors exceed the cap of {MAX_TENSORS}")
        end = 0
        names = set()
        for t in self.tensors:
            if t.name in names:
                raise ValueError(f"tensor name {t.name!r} appears twice")
            names.add(t.name)
            if t.offset < end:
                raise ValueError(f"tensor {t.name!r} overlaps the previous one (offsets must ascend)")
            end = t.offset + t.nbytes
            if end > self.total_bytes:
                raise ValueError(f"tensor {t.name!r} ends past total_bytes")

    @property
    def num_shards(self) -> int:
        return len(self.shard_hashes)

    def shard_range(self, index: int) -> tuple[int, int]:
        """(start, end) byte offsets of shard ``index`` in the content."""
        if not 0 <= index < self.num_shards:
            raise IndexError(f"shard {index} out of range 0..{self.num_shards - 1}")
        start = index * self.shard_bytes
        return start, min(start + self.shard_bytes, self.total_bytes)

    def shard_size(self, index: int) -> int:
        start, end = self.shard_range(index)
        return end - start


@message(tag=42)
@dataclass(frozen=True, slots=True, kw_only=True)
class ShardRequest:
    manifest_id: bytes
    index: int
    fallback: bool
    """Set once no other holder could serve this shard: asks a seeding publisher for a duplicate."""

    def __post_init__(self) -> None:
        _check_hash(self.manifest_id, "manifest_id")
        if not 0 <= self.index < MAX_SHARDS:
            raise ValueError("shard index out of range")


@message(tag=43)
@dataclass(frozen=True, slots=True, kw_only=True)
class ShardHeader:
    manifest_id: bytes
    index: int
    status: str
    nbytes: int
    sha256: bytes

    def __post_init__(self) -> None:
        _check_hash(self.manifest_id, "manifest_id")
        if self.status not in SHARD_STATUSES:
            raise ValueError(f"status must be one of {SHARD_STATUSES}")
        if not 0 <= self.nbytes <= MAX_SHARD_BYTES:
            raise ValueError(f"nbytes must be within 0..{MAX_SHARD_BYTES}")
        if self.status == STATUS_OK:
            _check_hash(self.sha256, "sha256")


@message(tag=44)
@dataclass(frozen=True, slots=True, kw_only=True)
class ShardAck:
    manifest_id: bytes
    index: int
    ok: bool
    reason: str


@message(tag=45, optional_tail=("arriving",))
@dataclass(frozen=True, slots=True, kw_only=True)
class Have:
    """Which shards of a manifest the signer holds, verified, right now; and which are on their way to it
    (``arriving``, empty or a bitfield like ``bitfield``), which it passes on as they arrive, the last bytes of each
    only once it verified the whole shard."""

    manifest_id: bytes
    num_shards: int
    bitfield: bytes
    arriving: bytes = b""

    def __post_init__(self) -> None:
        _check_hash(self.manifest_id, "manifest_id")
        if not 0 <= self.num_shards <= MAX_SHARDS:
            raise ValueError("num_shards out of range")
        if len(self.bitfield) != (self.num_shards + 7) // 8:
            raise ValueError("bitfield length does not match num_shards")
        if self.arriving and len(self.arriving) != len(self.bitfield):
            raise ValueError("arriving bitfield length does not match num_shards")


MAX_HAVES_PER_MESSAGE = 16
"""Haves one gossip message carries: a node's news after a round's transfers, or its periodic re-announcement."""


@message(tag=48)
@dataclass(frozen=True, slots=True, kw_only=True)
class Haves:
    """Several of the signer's Haves in one gossip message, one per manifest.

    Each gossip message costs a signature to make, two to check at every hop, and about 200 bytes of
    envelope on every link; a round's transfers leave several manifests changed at once."""

    haves: tuple[Have, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.haves) <= MAX_HAVES_PER_MESSAGE:
            raise ValueError(f"a Haves message carries 1 to {MAX_HAVES_PER_MESSAGE} Haves, not {len(self.haves)}")
        if len({h.manifest_id for h in self.haves}) != len(self.haves):
            raise ValueError("a Haves message names each manifest once")


@message(tag=46)
@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestRequest:
    manifest_id: bytes

    def __post_init__(self) -> None:
        _check_hash(self.manifest_id, "manifest_id")


@message(tag=47)
@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestResponse:
    """The sealed manifest (empty if unknown) and the responder's bitfield (empty if it holds nothing)."""

    sealed_manifest: bytes
    bitfield: bytes


def content_id(total_bytes: int, shard_bytes: int, shard_hashes: tuple[bytes, ...] | list[bytes]) -> bytes:
    h = hashlib.sha256(_CONTENT_DOMAIN)
    h.update(total_bytes.to_bytes(8, "big") + shard_bytes.to_bytes(8, "big"))
    for s in shard_hashes:
        h.update(s)
    return h.digest()


def manifest_id(m: Manifest) -> bytes:
    """The sha256 of the manifest's canonical encoding: what peers ask for and announce."""
    return hashlib.sha256(encode(m)).digest()


@dataclass(frozen=True, slots=True)
class SignedManifest:
    """A verified manifest, who signed it, its id, and the envelope bytes to pass on unchanged."""

    manifest: Manifest
    signer: str
    manifest_id: bytes
    sealed: bytes


def seal_manifest(m: Manifest, key: Keypair) -> SignedManifest:
    sealed = seal(m, key)
    return SignedManifest(manifest=m, signer=key.peer_id, manifest_id=manifest_id(m), sealed=sealed)


def open_manifest(sealed: bytes, *, expected_id: bytes | None = None) -> SignedManifest:
    """Verify a sealed manifest; DecodeError/SignatureError, or IntegrityError if its id is not ``expected_id``."""
    signed = open_sealed(sealed, expect=Manifest)
    mid = manifest_id(signed.message)
    if expected_id is not None and mid != expected_id:
        raise IntegrityError(f"manifest id {mid.hex()[:16]} is not the requested {expected_id.hex()[:16]}")
    return SignedManifest(manifest=signed.message, signer=signed.signer, manifest_id=mid, sealed=sealed)


def num_shards_for(total_bytes: int, shard_bytes: int) -> int:
    return -(-total_bytes // shard_bytes)


def make_manifest(*, kind: str, label: str, version: int, total_bytes: int, shard_bytes: int,
                  shard_hashes: list[bytes] | tuple[bytes, ...],
                  tensors: tuple[TensorEntry, ...] = ()) -> Manifest:
    """A manifest from precomputed shard hashes; LocalProtocolError if it would break a cap."""
    hashes = tuple(shard_hashes)
    try:
        m = Manifest(kind=kind, label=label, version=version, total_bytes=total_bytes,
                     shard_bytes=shard_bytes, shard_hashes=hashes,
                     content_id=content_id(total_bytes, shard_bytes, hashes), tensors=tuple(tensors))
    except ValueError as exc:
        raise LocalProtocolError(f"cannot build manifest: {exc}") from exc
    size = len(encode(m))
    if size > MAX_MANIFEST_BYTES:
        raise LocalProtocolError(f"manifest encodes to {size} bytes, over the cap of {MAX_MANIFEST_BYTES}; "
                                 "use larger shards or fewer tensors")
    return m


def build_manifest(data: bytes | bytearray | memoryview, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                   kind: str = KIND_FILE, label: str = "", version: int = 0,
                   tensors: tuple[TensorEntry, ...] = ()) -> Manifest:
    """Cut ``data`` into shards, hash each, and describe it."""
    view = memoryview(data).cast("B")
    total = len(view)
    hashes = [hashlib.sha256(view[start:start + shard_bytes]).digest()
              for start in range(0, total, shard_bytes)]
    return make_manifest(kind=kind, label=label, version=version, total_bytes=total,
                         shard_bytes=shard_bytes, shard_hashes=hashes, tensors=tensors)


def layout_tensors(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[tuple[TensorEntry, ...], int]:
    """Place (name, dtype, shape) tensors back to back on aligned offsets; returns entries and total bytes."""
    entries = []
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPE_BYTES:
            raise LocalProtocolError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        offset = -(-offset // TENSOR_ALIGN_BYTES) * TENSOR_ALIGN_BYTES
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        try:
            entries.append(TensorEntry(name=name, dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes))
        except ValueError as exc:
            raise LocalProtocolError(str(exc)) from exc
        offset += nbytes
    return tuple(entries), offset


def bitfield_from_indices(num_shards: int, indices) -> bytes:
    bits = bytearray((num_shards + 7) // 8)
    for i in indices:
        if not 0 <= i < num_shards:
            raise LocalProtocolError(f"shard {i} out of range")
        bits[i >> 3] |= 0x80 >> (i & 7)
    return bytes(bits)


def bitfield_indices(bitfield: bytes, num_shards: int) -> set[int]:
    """The set bits of a bitfield; bits past num_shards are ignored."""
    return {i for i in range(min(num_shards, len(bitfield) * 8)) if bitfield[i >> 3] & (0x80 >> (i & 7))}
