"""Highest-random-weight (rendezvous) hashing: who aggregates a shard, who trains on which data."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def make_key(*parts: str | int | bytes) -> bytes:
    """An unambiguous key from typed, length-prefixed parts, so ("ab", 1) never equals ("a", "b1")."""
    out = bytearray(b"shoal/hrw/v1")
    for part in parts:
        if isinstance(part, bool):
            raise TypeError("rendezvous key parts are str, int or bytes, not bool")
        if isinstance(part, int):
            kind, raw = b"i", str(part).encode()
        elif isinstance(part, str):
            kind, raw = b"s", part.encode()
        elif isinstance(part, bytes):
            kind, raw = b"b", part
        else:
            raise TypeError(f"rendezvous key parts are str, int or bytes, not {type(part).__name__}")
        out += kind + len(raw).to_bytes(4, "big") + raw
    return bytes(out)


def score(key: bytes, candidate: str) -> int:
    """The candidate's weight for this key: sha256 over the length-prefixed key and the candidate."""
    digest = hashlib.sha256(len(key).to_bytes(4, "big") + key + candidate.encode()).digest()
    return int.from_bytes(digest, "big")


def rank(key: bytes, candidates: Iterable[str]) -> list[str]:
    """Candidates best first; ties (never seen with sha256) fall back to the name for determinism."""
    return sorted(set(candidates), key=lambda c: (-score(key, c), c))


def top(key: bytes, candidates: Iterable[str], k: int) -> list[str]:
    """The k best candidates for this key (fewer if there are fewer candidates)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return rank(key, candidates)[:k]


def assign_shards(
    task_id: str, round_index: int, peers: list[str], num_shards: int, per_peer: int | None = None
) -> dict[str, list[int]]:
    """Data shards of one round, by peer: each shard goes to the peer that scores best for it.

    Every (shard, peer) pair is scored with the key (task, round, shard) and pairs are taken
    best first while the peer still has room, so the assignment is pure hashing wherever the
    balance allows. Room is balanced: with n = min(num_shards, peers * per_peer) shards handed
    out, every peer ends with n // peers or n // peers + 1 of them, hence at least one when
    num_shards >= len(peers). Shards beyond n (only when per_peer caps the round) are unassigned.
    """
    if len(set(peers)) != len(peers):
        raise ValueError("peers must be distinct")
    if num_shards < 0:
        raise ValueError(f"num_shards must be >= 0, got {num_shards}")
    if per_peer is not None and per_peer < 1:
        raise ValueError(f"per_peer must be >= 1, got {per_peer}")
    if not peers:
        return {}
    total = num_shards if per_peer is None else min(num_shards, per_peer * len(peers))
    base, extra = divmod(total, len(peers))
    pairs = []
    for shard in range(num_shards):
        key = make_key("shard", task_id, round_index, shard)
        pairs.extend((-score(key, peer), peer, shard) for peer in peers)
    pairs.sort()

    counts = dict.fromkeys(peers, 0)
    taken: dict[int, str] = {}
    num_full = 0  # peers that already hold base + 1 shards
    for _, peer, shard in pairs:
        if len(taken) == total:
            break
        if shard in taken:
            continue
        count = counts[peer]
        if count < base or (count == base and num_full < extra):
            taken[shard] = peer
            counts[peer] = count + 1
            if count + 1 == base + 1:
                num_full += 1
    assert len(taken) == total, "greedy assignment always fills the balanced capacity"

    result: dict[str, list[int]] = {peer: [] for peer in sorted(peers)}
    for shard, peer in sorted(taken.items()):
        result[peer].append(shard)
    return result


def checker(task_id: str, round_index: int, producer: str, candidates: Iterable[str]) -> str | None:
    """Who checks ``producer``'s update of a round (node/tasks/checks.py): the best-scoring other candidate,
    None when there is none. Every node that knows the same candidates names the same checker."""
    others = sorted({c for c in candidates if c != producer})
    chosen = top(make_key("check", task_id, round_index, producer), others, 1)
    return chosen[0] if chosen else None
