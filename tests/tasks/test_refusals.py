"""Bad input to the task service: refused with a clear reason, never run, never a crash."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import trio

from node import control
from node.tasks import compute
from node.train.compress import encode_int8
from p2p.api import GossipMessage
from protocol.envelope import seal
from protocol.errors import IntegrityError
from protocol.keys import Keypair
from protocol.manifest import build_manifest, layout_tensors
from protocol.spec_toml import load_spec_toml
from tests.tasks.conftest import Swarm, runner, tiny_spec, wait_until


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-task.toml"


def test_the_example_spec_loads():
    spec = load_spec_toml(EXAMPLE.read_text())
    assert spec.rounds == 10 and spec.min_members == 3 and spec.recipe == "tiny-lm"


async def one_node(nursery, tmp_path, network, **options):
    swarm = Swarm(nursery, tmp_path, network)
    return await swarm.add("a", **options)


async def test_unknown_recipe_is_declined_with_a_reason(network, tmp_path):
    async with trio.open_nursery() as nursery:
        node = await one_node(nursery, tmp_path, network)
        spec = dataclasses.replace(tiny_spec(), recipe="mystery")
        known = await node.tasks.consider(spec, "someone", seal(spec, Keypair.from_label("x")))
        assert known.decision == "declined" and "unknown recipe 'mystery'" in known.reason
        assert node.status()["task"]["declined"][0]["reason"] == known.reason
        nursery.cancel_scope.cancel()


async def test_initiator_not_allowed_is_declined(network, tmp_path):
    async with trio.open_nursery() as nursery:
        node = await one_node(nursery, tmp_path, network, allowed_initiators=("12D3KooWtrusted",))
        spec = tiny_spec()
        known = await node.tasks.consider(spec, "12D3KooWstranger", b"")
        assert known.decision == "declined" and "allowed_initiators" in known.reason
        nursery.cancel_scope.cancel()


async def test_a_node_not_among_the_listed_trainers_declines(network, tmp_path):
    async with trio.open_nursery() as nursery:
        node = await one_node(nursery, tmp_path, network)
        others = tuple(Keypair.from_label(f"listed-{i}").peer_id for i in range(3))
        spec = tiny_spec(trainers=others)
        known = await node.tasks.consider(spec, "someone", seal(spec, Keypair.from_label("x")))
        assert known.decision == "declined" and "not among the task's 3 listed trainers" in known.reason
        nursery.cancel_scope.cancel()


async def test_spec_with_a_bad_signature_is_dropped_and_costs_the_sender(network, tmp_path):
    async with trio.open_nursery() as nursery:
        node = await one_node(nursery, tmp_path, network)
        sealed = bytearray(seal(tiny_spec(), Keypair.from_label("initiator")))
        sealed[-10] ^= 0xFF  # inside the signature
        msg = GossipMessage(topic="shoal/tasks/1", data=bytes(sealed), forwarder="evil", origin="evil")
        assert node.tasks._validate_spec(msg) is False
        assert node.membership.scores.score("evil", trio.current_time()) < 0
        assert not node.tasks.tasks
        nursery.cancel_scope.cancel()


async def test_a_dataset_nobody_can_provide_is_declined(network, tmp_path):
    async with trio.open_nursery() as nursery:
        node = await one_node(nursery, tmp_path, network, dataset_wait_s=0.5)
        spec = tiny_spec(min_members=1, dataset={"sha256": "00" * 32})
        tid = await node.tasks.publish(spec)
        await wait_until(lambda: runner(node, tid).phase == "declined", timeout_s=20)
        assert "differs from this node's stdlib corpus" in runner(node, tid).detail
        nursery.cancel_scope.cancel()


async def test_publish_route_refuses_absurd_values_with_the_key(network, tmp_path):
    async with trio.open_nursery() as nursery:
        node = await one_node(nursery, tmp_path, network)
        toml = EXAMPLE.read_text().replace("rounds = 10", "rounds = 0")
        with pytest.raises(Exception) as info:
            await trio.to_thread.run_sync(lambda: control.call(node.control_url + "/task/publish", token=node.control_token, body={"toml": toml}))
        assert "rounds" in str(info.value)
        listed = await trio.to_thread.run_sync(lambda: control.call(node.control_url + "/tasks", token=node.control_token))
        assert listed == {"tasks": []}
        nursery.cancel_scope.cancel()


def _manifest_for(tensors):
    entries, total = layout_tensors([(n, "uint8", tuple(t.shape)) for n, t in tensors.items()])
    return build_manifest(bytes(total), shard_bytes=1024, kind="tensors", tensors=entries)


def test_a_slice_with_the_wrong_shape_or_bytes_is_rejected():
    numel = 1000
    good = encode_int8(torch.randn(numel))
    tensors = compute.payload_tensor(good)
    assert compute.payload_bytes(_manifest_for(tensors), tensors, numel) == good
    short = compute.payload_tensor(good[:-1])
    with pytest.raises(IntegrityError, match="one uint8 tensor"):
        compute.payload_bytes(_manifest_for(short), short, numel)
    extra = {**tensors, "more": torch.zeros(3, dtype=torch.uint8)}
    with pytest.raises(IntegrityError):
        compute.payload_bytes(_manifest_for(extra), extra, numel)
    bad_scale = bytearray(good)
    bad_scale[0:4] = bytes.fromhex("0000c0ff")  # a NaN block scale
    with pytest.raises(IntegrityError, match="bad int8 slice"):
        compute.decode_slice(bytes(bad_scale), numel)


def test_aggregate_is_deterministic_and_in_sorted_producer_order():
    numel = 777
    a, b = encode_int8(torch.randn(numel)), encode_int8(torch.randn(numel))
    one = compute.aggregate({"p1": (a, 10), "p2": (b, 30)}, numel)
    two = compute.aggregate({"p2": (b, 30), "p1": (a, 10)}, numel)
    assert one == two
    assert len(one[1]) == 64 and int(one[1], 16) >= 0  # a sha256 in hex


async def publish_weights(node, tmp_path, weights) -> str:
    from node.train.diloco import save_named
    path = tmp_path / "init.safetensors"
    save_named(path, weights)
    from protocol.manifest import manifest_id
    return manifest_id(await node.shardcast.publish_file(path)).hex()


async def test_init_manifest_weights_are_round_zeros_weights(network, tmp_path):
    async with trio.open_nursery() as nursery:
        node = await one_node(nursery, tmp_path, network)
        base = tiny_spec(min_members=1, rounds=1)
        start = {name: t + 0.5 for name, t in compute.initial_weights(base).items()}
        spec = dataclasses.replace(base, init_manifest=await publish_weights(node, tmp_path, start))
        tid = await node.tasks.publish(spec)
        await wait_until(lambda: runner(node, tid).agreement, timeout_s=60)
        from node.train.diloco import weights_hash
        # Round 0 trained from the published weights, not from the seeded init.
        assert runner(node, tid).machine.rounds_seen[0].base.weights_hash == weights_hash(start)
        assert weights_hash(start) != weights_hash(compute.initial_weights(base))
        nursery.cancel_scope.cancel()


async def test_init_manifest_with_the_wrong_layout_is_declined(network, tmp_path):
    async with trio.open_nursery() as nursery:
        node = await one_node(nursery, tmp_path, network)
        base = tiny_spec(min_members=1, rounds=1)
        wrong = {"tok_emb.weight": torch.zeros(3, 3)}
        spec = dataclasses.replace(base, init_manifest=await publish_weights(node, tmp_path, wrong))
        tid = await node.tasks.publish(spec)
        await wait_until(lambda: runner(node, tid).phase == "declined", timeout_s=30)
        assert "do not match the task's model" in runner(node, tid).detail
        nursery.cancel_scope.cancel()


def test_state_from_initial_keeps_the_weights_and_refuses_nan():
    spec = tiny_spec()
    start = {name: t * 2 for name, t in compute.initial_weights(spec).items()}
    state = compute.state_from_initial(spec, start)
    assert state.round == 0 and state.weights_hash() == compute.OuterState(0, start, state.outer).weights_hash()
    bad = dict(start)
    name = next(iter(bad))
    bad[name] = torch.full_like(bad[name], float("nan"))
    with pytest.raises(IntegrityError, match="NaN"):
        compute.state_from_initial(spec, bad)
