"""Model bundles: a checked directory round-trips; pickle, remote code, strays and mismatched tokenizers are refused."""

import json
import shutil

import pytest

from node import bundle


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_model_directory_round_trips_through_a_bundle(tiny_llama, tmp_path):
    info = bundle.pack(tiny_llama, tmp_path / "m.bundle")
    assert info.architecture == "LlamaForCausalLM" and info.num_params > 0
    got = bundle.unpack(tmp_path / "m.bundle", tmp_path / "out")
    assert got == info
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == bundle.read_dir(tiny_llama)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pkl"])
def test_pickled_weights_are_refused(tiny_llama, tmp_path, name):
    d = copy(tiny_llama, tmp_path / "m")
    (d / name).write_bytes(b"\x80\x04pickle")
    with pytest.raises(bundle.ModelRefused, match="pickle"):
        bundle.pack(d, tmp_path / "m.bundle")


def test_remote_code_is_refused(tiny_llama, tmp_path):
    d = copy(tiny_llama, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(bundle.ModelRefused, match="remote code"):
        bundle.pack(d, tmp_path / "m.bundle")
    (d / "modeling_evil.py").write_text("import os")
    with pytest.raises(bundle.ModelRefused):
        bundle.pack(d, tmp_path / "m.bundle")


def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny_llama, tmp_path):
    d = copy(tiny_llama, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["vocab_size"] = 50
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(bundle.ModelRefused, match="tokenizer does not match the model"):
        bundle.pack(d, tmp_path / "m.bundle")


def test_a_tampered_bundle_is_refused_before_anything_is_written(tiny_llama, tmp_path):
    bundle.pack(tiny_llama, tmp_path / "m.bundle")
    data = bytearray((tmp_path / "m.bundle").read_bytes())
    data[-10] ^= 0xFF
    (tmp_path / "bad.bundle").write_bytes(bytes(data))
    with pytest.raises(bundle.ModelRefused, match="hash"):
        bundle.unpack(tmp_path / "bad.bundle", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_bundle_naming_a_pickle_is_refused_on_unpack(tmp_path):
    header = json.dumps({"files": [{"name": "pytorch_model.bin", "size": 1, "sha256": "0" * 64}]}).encode()
    (tmp_path / "evil.bundle").write_bytes(bundle.MAGIC + len(header).to_bytes(8, "little") + header + b"x")
    with pytest.raises(bundle.ModelRefused, match="pickle"):
        bundle.unpack(tmp_path / "evil.bundle", tmp_path / "out")
