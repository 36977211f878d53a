"""The stdlib corpus: deterministic, verified by content hash, split and sampled reproducibly."""

import pytest
import torch

from node.train.data import batches, build_corpus, corpus_id, derive_seed, load_or_build, split_corpus, split_ranges
from protocol.errors import ConfigError

SMALL = 64 * 1024


def test_corpus_is_deterministic_and_capped():
    a, b = build_corpus(SMALL), build_corpus(SMALL)
    assert len(a) == SMALL and corpus_id(a) == corpus_id(b)
    assert a.startswith(b"\n# ==== __future__.py ====\n")


def test_file_selection_and_order(tmp_path):
    for rel in ["b/c.py", "a.py", "test/t.py", "pkg/tests/u.py", "site-packages/x.py", "idlelib/i.py",
                "_sysconfigdata_x.py", "config-3.11/y.py", "notes.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    data = build_corpus(1 << 20, root=tmp_path)
    assert data == b"\n# ==== a.py ====\n# a.py\n\n# ==== b/c.py ====\n# b/c.py\n"


def test_cache_and_expected_hash(tmp_path):
    data = load_or_build(tmp_path, SMALL)
    cid = corpus_id(data)
    assert (tmp_path / f"{cid}.corpus").read_bytes() == data
    assert load_or_build(tmp_path, SMALL, expected_id=cid) == data
    with pytest.raises(ConfigError, match="differs on this Python version"):
        load_or_build(tmp_path, SMALL, expected_id="0" * 64)


def test_a_corpus_fetched_from_peers_is_used_by_its_id(tmp_path):
    fetched = b"def f():\n    return 1\n" * 100
    (tmp_path / f"{corpus_id(fetched)}.corpus").write_bytes(fetched)
    assert load_or_build(tmp_path, SMALL, expected_id=corpus_id(fetched)) == fetched


def test_split_covers_the_corpus_with_a_heldout_tail():
    ranges, heldout = split_ranges(1000, 3)
    assert ranges == [(0, 316), (316, 633), (633, 950)] and heldout == (950, 1000)
    shards, held = split_corpus(bytes(range(256)) * 4, 3)
    assert b"".join(shards) + held == bytes(range(256)) * 4


def test_batches_are_seeded_windows_of_the_data():
    data = bytes(range(200))
    a = next(batches(data, seq_len=8, batch_size=4, seed=derive_seed("task", 1, "peer")))
    b = next(batches(data, seq_len=8, batch_size=4, seed=derive_seed("task", 1, "peer")))
    c = next(batches(data, seq_len=8, batch_size=4, seed=derive_seed("task", 2, "peer")))
    assert a.shape == (4, 9) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 8, dtype=torch.long))
    with pytest.raises(ValueError):
        next(batches(b"short", seq_len=8, batch_size=1, seed=0))
