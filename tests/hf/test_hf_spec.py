"""Task specs for the hf recipes: strict validation, TOML without a model table, and the codec round trip."""

import pytest

from protocol.codec import decode, encode
from protocol.errors import ConfigError
from protocol.spec_toml import spec_from_dict
from protocol.task import TaskSpec

H = "ab" * 32


def fields(**over):
    base = {"name": "ft", "recipe": "hf-causal-lm", "inner_steps": 5, "batch_size": 4, "rounds": 3,
            "dataset": {"kind": "published", "manifest": H, "sha256": "cd" * 32, "max_bytes": 4096, "num_shards": 2},
            "hf": {"model_manifest": H, "method": "lora", "target_modules": ["q_proj", "v_proj"]}}
    base.update(over)
    return base


def test_an_hf_spec_round_trips_through_the_codec():
    spec = spec_from_dict(fields(), created_ms=1)
    assert spec.model is None and spec.hf.target_modules == ("q_proj", "v_proj")
    assert decode(encode(spec), expect=TaskSpec) == spec


@pytest.mark.parametrize("over, match", [
    ({"hf": None}, "needs an hf table"),
    ({"hf": {"model_manifest": "nope"}}, "model_manifest"),
    ({"hf": {"model_manifest": H, "method": "qlora"}}, "hf.method"),
    ({"hf": {"model_manifest": H, "target_modules": ["q_proj; rm"]}}, "target_modules"),
    ({"dataset": {"kind": "stdlib-corpus", "sha256": "cd" * 32, "max_bytes": 4096, "num_shards": 2}}, "published"),
    ({"dataset": {"kind": "published", "sha256": "cd" * 32, "max_bytes": 4096, "num_shards": 2}}, "dataset.manifest"),
    ({"model": {"n_layer": 1, "n_head": 1, "d_model": 8, "seq_len": 8}}, "drop the model table"),
    ({"requirements": {"torch_version": "2.13; x"}}, "torch_version"),
    ({"recipe": "hf-dpo", "hf": {"model_manifest": H, "method": "full"}}, "hf-dpo"),
])
def test_bad_hf_specs_name_the_mistake(over, match):
    with pytest.raises(ConfigError, match=match):
        spec_from_dict(fields(**over), created_ms=1)


def test_tiny_lm_specs_still_need_their_model_table():
    with pytest.raises(ConfigError, match="model"):
        spec_from_dict({"name": "t", "inner_steps": 1, "batch_size": 1, "rounds": 1,
                        "dataset": {"kind": "stdlib-corpus", "sha256": "cd" * 32, "max_bytes": 4096,
                                    "num_shards": 1}}, created_ms=1)


def test_the_finetune_example_loads():
    from pathlib import Path

    from protocol.spec_toml import load_spec_toml
    text = (Path(__file__).resolve().parents[2] / "examples" / "finetune-task.toml").read_text()
    spec = load_spec_toml(text)
    assert spec.recipe == "hf-causal-lm" and spec.hf.method == "lora" and spec.dataset.kind == "published"
