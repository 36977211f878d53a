"""Several local processes in one node's inner loop: a train request for 2 gloo ranks gives the update that 1
process gives on the same batches (the trainer child's own request handler, for the tiny LM, LoRA and DPO)."""

import json

import pytest
import torch

from node.dataset import encode_records
from node.train import worker
from node.train.data import build_corpus
from node.train.diloco import load_named, named_tensors, save_named
from node.train.model import ModelConfig, init_model
from node.train.ranks import usable_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def train(tmp_path, req: dict, processes: int, name: str, *, shard: bool = False) -> tuple[dict, dict]:
    out = tmp_path / f"{name}-update.safetensors"
    reply = worker.handle_train({**req, "processes": processes, "out_path": str(out), "device": "cpu",
                                 "opt_state_path": str(tmp_path / f"{name}-opt.safetensors"), "shard": shard})
    return reply, load_named(str(out))


def assert_same_update(one: dict, two: dict, half: dict) -> None:
    assert one.keys() == two.keys()
    moved = max(float(t.abs().max()) for t in one.values())
    diff = max(float((one[n] - two[n]).abs().max()) for n in one)
    assert moved > 1e-4, "training did not move the weights"
    assert diff < 1e-5 * max(1.0, moved) + 1e-6, (diff, moved)
    # The same steps on half the rows (what one rank alone sees) differ: the check can fail.
    assert max(float((half[n] - two[n]).abs().max()) for n in half) > 10 * diff + 1e-6


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_the_tiny_lm_on_two_gloo_ranks_matches_one_process(tmp_path, shard):
    config = ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=16)
    save_named(str(tmp_path / "base.safetensors"), named_tensors(init_model(config, seed=3)))
    (tmp_path / "corpus").write_bytes(build_corpus(64 * 1024))
    req = {"model": config.to_dict(), "base_path": str(tmp_path / "base.safetensors"),
           "data_path": str(tmp_path / "corpus"), "shard_ranges": [[0, 64 * 1024]], "steps": 6, "batch_size": 8,
           "seed": 11, "adamw": {"lr": 3e-3, "weight_decay": 0.0}, "log_every": 2}
    one_reply, one = train(tmp_path, req, 1, "one")
    two_reply, two = train(tmp_path, req, 2, "two", shard=shard)
    _, half = train(tmp_path, {**req, "batch_size": 4}, 1, "half")
    assert_same_update(one, two, half)
    assert (two_reply["steps"], two_reply["samples"]) == (one_reply["steps"], one_reply["samples"]) == (6, 48)
    assert two_reply["device"] == ("cpu x2 sharded" if shard else "cpu x2")
    # The committed losses are the whole batch's, not rank 0's half.
    for (s1, l1), (s2, l2) in zip(one_reply["losses"], two_reply["losses"]):
        assert s1 == s2 and abs(l1 - l2) < 1e-4, (one_reply["losses"], two_reply["losses"])
    # The optimizer state carries over to the next round the same way, whole, and is read back in.
    torch.testing.assert_close(load_named(str(tmp_path / "one-opt.safetensors")),
                               load_named(str(tmp_path / "two-opt.safetensors")), atol=1e-6, rtol=1e-4)
    _, one2 = train(tmp_path, {**req, "seed": 12}, 1, "one")
    _, two2 = train(tmp_path, {**req, "seed": 12}, 2, "two", shard=shard)
    _, half2 = train(tmp_path, {**req, "seed": 12, "batch_size": 4}, 1, "half")
    assert_same_update(one2, two2, half2)


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("recipe, method", [("hf-causal-lm", "lora"), ("hf-dpo", "lora"), ("hf-causal-lm", "full")])
def test_an_hf_model_on_two_gloo_ranks_matches_one_process(tiny_llama, tmp_path, recipe, method, shard):
    """LoRA (the adapter trained), DPO, and full fine-tuning (every weight trained; sharded, each rank holds half
    of each and of its AdamW state)."""
    from node.train import recipes
    if recipe == "hf-dpo":
        records = [{"prompt": f"q{i}: what is {i} plus {i}?", "chosen": f" it is {2 * i}.",
                    "rejected": f" maybe {i + 7}, or not."} for i in range(24)]
    else:
        records = [{"text": f"record {i}: ada has {i} red keys and gives {i % 3} away."} for i in range(40)]
    (tmp_path / "records").write_bytes(encode_records(records))
    model = {"recipe": recipe, "model_dir": str(tiny_llama), "method": method, "seq_len": 16}
    recipes.prepare({"model": model, "data_path": str(tmp_path / "records"), "seed": 5,
                     "out_path": str(tmp_path / "base.safetensors")})
    req = {"model": model, "base_path": str(tmp_path / "base.safetensors"), "data_path": str(tmp_path / "records"),
           "shard_ranges": [[0, len(records)]], "steps": 4, "batch_size": 4, "seed": 9,
           "adamw": {"lr": 1e-2 if method == "lora" else 1e-3, "weight_decay": 0.0}, "log_every": 1}
    from node.train import hf
    one_reply, one = train(tmp_path, req, 1, "one")
    assert hf._built  # one process keeps its model for the next request
    two_reply, two = train(tmp_path, req, 2, "two", shard=shard)
    assert not hf._built  # the ranks build their own: none is left idle beside them
    _, half = train(tmp_path, {**req, "batch_size": 2}, 1, "half")
    assert_same_update(one, two, half)
    assert two_reply["samples"] == one_reply["samples"] == 16
    assert two_reply["device"] == ("cpu x2 sharded" if shard else "cpu x2")
    assert json.dumps(sorted(one)) == json.dumps(sorted(two))  # the adapter's tensors only, by name


def test_ranks_are_as_many_as_the_devices_and_the_batch_allow():
    assert usable_processes(4, 8, cuda=False) == 4
    assert usable_processes(4, 6, cuda=False) == 3  # 6 rows split evenly over 3, not 4
    assert usable_processes(3, 7, cuda=False) == 1
    assert usable_processes(0, 8, cuda=False) == 1
    assert usable_processes(8, 16, cuda=True) == max(1, min(8, torch.cuda.device_count()))  # one rank per GPU


def test_a_rank_that_fails_fails_the_request_with_its_reason(tmp_path):
    config = ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=16)
    (tmp_path / "corpus").write_bytes(build_corpus(16 * 1024))
    req = {"model": config.to_dict(), "base_path": str(tmp_path / "missing.safetensors"),
           "data_path": str(tmp_path / "corpus"), "shard_ranges": [[0, 16 * 1024]], "steps": 2, "batch_size": 4,
           "seed": 1}
    with pytest.raises(Exception, match="missing.safetensors"):
        train(tmp_path, req, 2, "bad")


def _probe(ranks, fail_on: int = -1) -> dict:
    """A job for the pool: every rank's pid, gathered over the group; rank ``fail_on`` raises."""
    import os

    import torch.distributed as dist
    if ranks.rank == fail_on:
        raise ValueError(f"rank {ranks.rank} was told to fail")
    pids = [None] * ranks.world
    dist.all_gather_object(pids, os.getpid())
    return {"pids": pids}


def test_the_rank_processes_are_kept_between_requests_and_replaced_when_one_fails_or_dies():
    import functools
    import os
    import signal
    import time

    from node.train import ranks as ranks_mod
    ranks_mod.close_ranks()
    first = ranks_mod.run_ranks(2, _probe, cuda=False)["pids"]
    assert ranks_mod.run_ranks(2, _probe, cuda=False)["pids"] == first  # the same processes, the group set up once
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*told to fail"):
        ranks_mod.run_ranks(2, functools.partial(_probe, fail_on=1), cuda=False)
    assert not any(_alive(p) for p in first)  # a failed job closes the pool
    second = ranks_mod.run_ranks(2, _probe, cuda=False)["pids"]
    assert set(second).isdisjoint(first)
    os.kill(second[1], signal.SIGKILL)  # a rank that dies between requests
    deadline = time.monotonic() + 10
    # Until its last thread has exited (a zombie leader with threads still going is not reaped yet).
    while ranks_mod._pool.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    third = ranks_mod.run_ranks(2, _probe, cuda=False)["pids"]
    assert set(third).isdisjoint(second) and not _alive(second[0])
    ranks_mod.close_ranks()
    assert not any(_alive(p) for p in third)


def _alive(pid: int) -> bool:
    """Running, not a zombie (reaping it here would hide its death from multiprocessing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
