"""A producer's error feedback across rounds: the residual its last update left is carried in memory, written to
disk off the round's path, and a round redone after a restart starts from the same residual as the first try."""

from __future__ import annotations

import pytest
import torch
import trio

from p2p.fake import FakeNetwork

from node.shardcast import ShardcastConfig
from node.tasks import compute, task_files
from node.tasks.exchange import Exchange
from node.train.diloco import save_named
from tests.shardcast.conftest import FAST, Swarm
from tests.tasks.conftest import tiny_spec

TASK = "cd" * 32


@pytest.fixture
async def swarm(nursery, tmp_path):
    yield Swarm(nursery, tmp_path, FakeNetwork())


def delta(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(33, 17, generator=gen) * 1e-2, "b": torch.randn(1000, generator=gen) * 1e-2}


async def test_the_residual_is_carried_in_memory_and_a_restart_redoes_a_round_from_the_one_on_disk(
        swarm, tmp_path, monkeypatch):
    spec = tiny_spec(compression="int2")
    node = await swarm.add("a", config=ShardcastConfig(**{**FAST, "keep_manifests": 64}))
    directory = tmp_path / "task"
    directory.mkdir()

    def exchange() -> Exchange:
        return Exchange(shardcast=node.service, spec=spec, task_id=TASK, directory=directory, keypair=node.keypair,
                        penalize=lambda peer, why: None, num_params=lambda: 33 * 17 + 1000)

    async def publish(ex: Exchange, round_: int) -> list[str]:
        path = directory / f"update{round_}.safetensors"
        save_named(path, delta(round_))
        with trio.fail_after(30):
            return await ex.publish_update(path, round_)

    first = exchange()
    ids = [await publish(first, r) for r in range(2)]
    # Round 2 starts from round 1's residual, in memory: nothing is read back from disk.
    load = task_files.load_residual
    monkeypatch.setattr(task_files, "load_residual", lambda *a: pytest.fail("read the residual back from disk"))
    ids.append(await publish(first, 2))
    monkeypatch.setattr(task_files, "load_residual", load)
    # What each round sent is the chain of feedback, round by round.
    residual = None
    for r in range(3):
        payloads, residual = compute.split_with_feedback(delta(r), spec.aggregation_shards,
                                                         first.codec, residual)
        sent = [node.service.load_tensors(node.store.get_manifest(bytes.fromhex(i)).manifest) for i in ids[r]]
        assert [compute.tensor_bytes(t[compute.PAYLOAD]) for t in sent] == [bytes(p) for p in payloads], r
    await trio.to_thread.run_sync(task_files.wait_residual, directory)
    assert sorted(p.name for p in directory.glob("residual-r*")) == ["residual-r1.safetensors",
                                                                     "residual-r2.safetensors"]
    # Redoing round 2 starts from round 1's residual again, not from the one round 2 left.
    assert await publish(first, 2) == ids[2]
    # A restart redoing round 2 starts from round 1's residual, on disk, as the first try did: the same slices.
    assert await publish(exchange(), 2) == ids[2]


async def test_a_slice_of_one_shard_goes_unseeded_and_one_of_several_is_seeded(swarm, tmp_path):
    """One shard cannot be passed on piece by piece, so the producer serves each aggregator itself and nobody
    gossips a Have of it; a slice of several shards is seeded, so the aggregators pass shards on to each other."""
    spec = tiny_spec(compression="int8")
    numel = 10_000  # two int8 slices of about 5 KB
    for shard_bytes, seeded in ((64 * 1024, False), (1024, True)):
        node = await swarm.add(f"p{shard_bytes}", config=ShardcastConfig(**{**FAST, "shard_bytes": shard_bytes}))
        directory = tmp_path / f"task{shard_bytes}"
        directory.mkdir()
        ex = Exchange(shardcast=node.service, spec=spec, task_id=TASK, directory=directory, keypair=node.keypair,
                      penalize=lambda peer, why: None, num_params=lambda: numel)
        path = directory / "update0.safetensors"
        save_named(path, {"w": torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-2})
        with trio.fail_after(30):
            ids = [bytes.fromhex(i) for i in await ex.publish_update(path, 0)]
        shards = [node.store.get_manifest(i).manifest.num_shards for i in ids]
        assert all(n > 1 for n in shards) if seeded else shards == [1] * len(ids), shards
        assert all((i in node.service._seeds) is seeded and (i in node.service._quiet) is not seeded for i in ids)
        assert [ex._one_shard(len(bytes(compute.tensor_bytes(node.service.load_tensors(
            node.store.get_manifest(i).manifest)[compute.PAYLOAD])))) for i in ids] == [not seeded] * len(ids)
