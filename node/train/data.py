"""The built-in text corpus (the stdlib's own .py sources), its shards, and seeded batch sampling."""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import sysconfig
from collections.abc import Iterator

import torch

from node.fsutil import write_atomic
from protocol.errors import ConfigError

DEFAULT_CORPUS_BYTES = 4 * 1024 * 1024
HELDOUT_FRACTION = 0.05

# Tests and GUI demos are skipped as noise; encodings/ and pydoc_data/ are generated tables
# that would fill the sorted prefix (and the held-out tail) with near-identical lines;
# site-packages differs per machine; config-* and _sysconfigdata* embed this build's paths.
_SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "__pycache__",
    "encodings", "pydoc_data",
}
_SKIP_DIR_PREFIXES = ("config-",)
_SKIP_FILE_PREFIXES = ("_sysconfigdata",)


def _source_files(root: pathlib.Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(_SKIP_DIR_PREFIXES)]
        for name in filenames:
            path = pathlib.Path(dirpath, name)
            if name.endswith(".py") and not name.startswith(_SKIP_FILE_PREFIXES) and path.is_file():
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def build_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, root: str | os.PathLike | None = None) -> bytes:
    """The stdlib's .py files in sorted relative-path order, each after a header line, cut at max_bytes."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = pathlib.Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for rel in _source_files(root):
        out += b"\n# ==== " + rel.encode() + b" ====\n"
        out += (root / rel).read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def corpus_id(data: bytes) -> str:
    """The corpus's content hash: sha256 hex of its bytes."""
    return hashlib.sha256(data).hexdigest()


def load_or_build(
    cache_dir: str | os.PathLike, max_bytes: int = DEFAULT_CORPUS_BYTES, expected_id: str | None = None
) -> bytes:
    """The corpus from cache_dir/<id>.corpus if present and intact, else built here and cached.

    A corpus fetched from peers is used by placing it at cache_dir/<expected_id>.corpus.
    """
    cache = pathlib.Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if expected_id is not None:
        cached = cache / f"{expected_id}.corpus"
        if cached.is_file():
            data = cached.read_bytes()
            if corpus_id(data) == expected_id:
                return data
            cached.unlink()  # torn or tampered: rebuild below rather than trust it
    data = build_corpus(max_bytes)
    built_id = corpus_id(data)
    if expected_id is not None and built_id != expected_id:
        raise ConfigError(
            f"the stdlib corpus built on Python {sys.version.split()[0]} has id {built_id[:16]}..., "
            f"the task expects {expected_id[:16]}...: the corpus differs on this Python version; "
            f"fetch it from peers into {cache / (expected_id + '.corpus')}"
        )
    path = cache / f"{built_id}.corpus"
    if not path.is_file():
        write_atomic(path, data)
    return data


def split_ranges(
    num_bytes: int, num_shards: int, heldout_fraction: float = HELDOUT_FRACTION
) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Byte ranges [start, end) of num_shards equal training shards, then the held-out tail."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    train_bytes = num_bytes - int(num_bytes * heldout_fraction)
    bounds = [train_bytes * i // num_shards for i in range(num_shards + 1)]
    return list(zip(bounds[:-1], bounds[1:])), (train_bytes, num_bytes)


def split_corpus(
    data: bytes, num_shards: int, heldout_fraction: float = HELDOUT_FRACTION
) -> tuple[list[bytes], bytes]:
    """(training shards, held-out bytes) of a corpus; see split_ranges."""
    shard_ranges, (held_start, held_end) = split_ranges(len(data), num_shards, heldout_fraction)
    return [data[s:e] for s, e in shard_ranges], data[held_start:held_end]


def derive_seed(*parts: str | int) -> int:
    """A 63-bit seed from (task id, round, peer, ...), so a validator can rebuild any peer's sampler."""
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def batches(shard_bytes: bytes, seq_len: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless LongTensor batches [batch_size, seq_len + 1] of windows at seeded uniform offsets."""
    window = seq_len + 1
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    if len(shard_bytes) < window:
        raise ValueError(f"data of {len(shard_bytes)} bytes is shorter than one window of {window}")
    data = torch.frombuffer(bytearray(shard_bytes), dtype=torch.uint8)
    offsets = torch.arange(window)
    gen = torch.Generator().manual_seed(seed)
    num_starts = len(shard_bytes) - window + 1
    while True:
        starts = torch.randint(0, num_starts, (batch_size,), generator=gen)
        yield data[starts[:, None] + offsets].long()


def _ranges(value, size: int) -> list[tuple[int, int]]:
    if not isinstance(value, list) or not value:
        raise ValueError("shard_ranges must be a non-empty list of [start, end]")
    out = []
    for r in value:
        if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)
                and 0 <= r[0] < r[1] <= size):
            raise ValueError(f"byte range {r!r} is not [start, end) inside the {size} byte data file")
        out.append((r[0], r[1]))
    return out


def read_ranges(path: str | os.PathLike, ranges_value) -> bytes:
    """The bytes of these [start, end) ranges of the file, concatenated in order; ValueError for a range that is
    not a non-empty list of [start, end) pairs inside the file (they come in trainer requests)."""
    size = os.path.getsize(path)
    out = bytearray()
    with open(path, "rb") as f:
        for start, end in _ranges(ranges_value, size):
            f.seek(start)
            out += f.read(end - start)
    return bytes(out)
