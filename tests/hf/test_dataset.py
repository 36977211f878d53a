"""Datasets: canonical records from JSON lines and text, one hash for the same content, the spec's split."""

import json

import pytest

from node import dataset
from protocol.errors import ConfigError


def test_the_same_records_give_the_same_bytes_whatever_the_json_spelling(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "héllo", "id": 1}\n\n{"id": 2, "text": "world"}\n')
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "héllo"}) + "\n" + json.dumps({"text": "world"}) + "\n")
    a = dataset.encode_records(dataset.read_sources([tmp_path / "a.jsonl"]))
    b = dataset.encode_records(dataset.read_sources([tmp_path / "b.jsonl"]))
    assert a == b and dataset.content_hash(a) == dataset.content_hash(b)
    assert dataset.decode_records(a) == [{"text": "héllo"}, {"text": "world"}]


def test_plain_text_is_a_record_per_paragraph_and_pairs_are_kept(tmp_path):
    (tmp_path / "t.txt").write_text("one\nline\n\ntwo\n\n\n")
    assert dataset.read_sources([tmp_path / "t.txt"]) == [{"text": "one\nline"}, {"text": "two"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": "r", "x": 1}) + "\n")
    recs = dataset.read_sources([tmp_path / "p.jsonl"])
    assert recs == [{"prompt": "p", "chosen": "c", "rejected": "r"}] and dataset.is_pairs(recs)


def test_bad_input_gets_a_clear_reason(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="--text-field"):
        dataset.read_sources([tmp_path / "a.jsonl"])
    assert dataset.read_sources([tmp_path / "a.jsonl"], text_field="body") == [{"text": "x"}]
    (tmp_path / "b.jsonl").write_text("not json\n")
    with pytest.raises(ConfigError, match="b.jsonl:1"):
        dataset.read_sources([tmp_path / "b.jsonl"])


def test_split_keeps_the_held_out_tail_apart():
    shards, held = dataset.split_records(100, 4, 0.1)
    assert held == (90, 100) and shards[0] == (0, 22) and shards[-1][1] == 90
    with pytest.raises(ConfigError, match="num_shards"):
        dataset.split_records(5, 8, 0.1)
