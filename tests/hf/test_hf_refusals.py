"""Bad input to an hf task, each declined with a clear reason and nothing run: pickle or remote code in the model
bundle, a dataset whose bytes do not hash to the spec's sha256, a model too big for the node, a torch pin."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import trio

from node import bundle, dataset
from protocol.manifest import manifest_id
from protocol.spec_toml import spec_from_dict
from scripts.tiny_hf import text_records
from tests.tasks.conftest import Swarm, network, runner, wait_until  # noqa: F401 (network is a fixture)

pytestmark = [pytest.mark.timeout(90)]


def raw_bundle(files: dict[str, bytes]) -> bytes:
    """A bundle written without pack()'s checks, as a hostile initiator could."""
    entries = [{"name": n, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()]
    header = json.dumps({"files": entries}).encode()
    return bundle.MAGIC + len(header).to_bytes(8, "little") + header + b"".join(files.values())


async def publish(node, tmp_path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return manifest_id(await node.shardcast.publish_file(path)).hex()


async def hf_spec(node, tmp_path, model_bytes: bytes, *, sha256: str | None = None, **over):
    data = dataset.encode_records(text_records(60))
    data_id = await publish(node, tmp_path, "data.jsonl", data)
    model_id = await publish(node, tmp_path, "model.bundle", model_bytes)
    fields = {"name": "refuse", "recipe": "hf-causal-lm", "inner_steps": 2, "batch_size": 2, "rounds": 1,
              "min_members": 1, "created_ms": 1,
              "dataset": {"kind": "published", "manifest": data_id, "sha256": sha256 or dataset.content_hash(data),
                          "max_bytes": len(data) + 1024, "num_shards": 2, "heldout_fraction": 0.1},
              "hf": {"model_manifest": model_id, "seq_len": 16}, **over}
    return spec_from_dict(fields)


async def declined(network, tmp_path, make_spec, setup=None) -> str:
    async with trio.open_nursery() as nursery:
        node = await Swarm(nursery, tmp_path, network).add("a", dataset_wait_s=3.0)
        if setup is not None:
            setup(node)
        tid = await node.tasks.publish(await make_spec(node))
        await wait_until(lambda: runner(node, tid).phase in ("declined", "failed", "finished"), timeout_s=60)
        task = runner(node, tid)
        assert task.phase == "declined", (task.phase, task.detail)
        assert task.state is None, "a declined task must not have trained"
        nursery.cancel_scope.cancel()
    return task.detail


async def test_a_bundle_holding_a_pickle_is_declined(network, tmp_path, tiny_llama):
    files = {**bundle.read_dir(tiny_llama), "pytorch_model.bin": b"\x80\x04evil"}
    reason = await declined(network, tmp_path, lambda node: hf_spec(node, tmp_path, raw_bundle(files)))
    assert "pickle" in reason and "pytorch_model.bin" in reason


async def test_a_model_asking_for_remote_code_is_declined(network, tmp_path, tiny_llama):
    files = bundle.read_dir(tiny_llama)
    config = json.loads(files["config.json"])
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    files["config.json"] = json.dumps(config).encode()
    reason = await declined(network, tmp_path, lambda node: hf_spec(node, tmp_path, raw_bundle(files)))
    assert "remote code" in reason


async def test_a_tokenizer_that_does_not_fit_the_model_is_declined(network, tmp_path, tiny_llama):
    files = bundle.read_dir(tiny_llama)
    config = json.loads(files["config.json"])
    config["vocab_size"] = 64
    files["config.json"] = json.dumps(config).encode()
    reason = await declined(network, tmp_path, lambda node: hf_spec(node, tmp_path, raw_bundle(files)))
    assert "tokenizer does not match the model" in reason


async def test_a_dataset_whose_hash_does_not_match_is_declined(network, tmp_path, tiny_llama):
    good = raw_bundle(bundle.read_dir(tiny_llama))
    reason = await declined(network, tmp_path, lambda node: hf_spec(node, tmp_path, good, sha256="ee" * 32))
    assert "dataset hash mismatch" in reason


async def test_a_model_too_big_for_the_node_is_declined(network, tmp_path, tiny_llama):
    good = raw_bundle(bundle.read_dir(tiny_llama))

    def small(node):
        node.membership.hardware = dataclasses.replace(node.membership.hardware, memory_bytes=64 << 20)
    reason = await declined(network, tmp_path, lambda node: hf_spec(node, tmp_path, good), setup=small)
    assert "GiB to train and this node has 0.1 GiB" in reason


async def test_a_task_pinning_another_torch_is_declined(network, tmp_path, tiny_llama):
    good = raw_bundle(bundle.read_dir(tiny_llama))
    reason = await declined(network, tmp_path, lambda node: hf_spec(
        node, tmp_path, good, requirements={"min_memory_bytes": 0, "device": "any", "torch_version": "1.0.0"}))
    assert "pins torch 1.0.0" in reason and "this node's trainer runs torch" in reason
