"""Streaming fragments (task option ``fragments``): the model cut into contiguous pieces of about equal size, a
member's drift carried between its fragment's syncs, the outer step on one fragment only, error feedback kept per
tensor; and three nodes over the fake network syncing one fragment a round and agreeing on every round's weights."""

from __future__ import annotations

import pytest
import torch
import trio

from node.tasks import compute
from node.tasks.exchange import Exchange
from node.tasks.fragments import Drift
from node.train.codecs import CODECS
from node.train.diloco import (OuterNesterov, fragments, load_named, local_weights, named_tensors, save_named,
                               streaming_update)
from node.train.model import ModelConfig, init_model
from protocol.codec import decode, encode
from protocol.errors import ConfigError
from protocol.task import task_id
from tests.tasks.conftest import Swarm, finished, runner, tiny_spec, wait_until


def _weights() -> dict:
    return named_tensors(init_model(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=32), 0))


def test_the_model_is_cut_into_contiguous_fragments_of_about_equal_size_each_with_a_tensor():
    w = _weights()
    sizes = [(n, w[n].numel()) for n in sorted(w)]
    for count in (1, 2, 3, 4, 16):
        split = fragments(sizes, count)
        assert [n for f in split for n in f] == [n for n, _ in sizes]  # every tensor once, in sorted order
        assert len(split) == count and all(split)
        totals = [sum(w[n].numel() for n in f) for f in split]
        if count <= 4:
            assert max(totals) <= 1.5 * sum(totals) / count, totals
    assert fragments([("a", 100), ("b", 1), ("c", 1)], 3) == [("a",), ("b",), ("c",)]
    with pytest.raises(ValueError, match="need 1..3"):
        fragments([("a", 1), ("b", 1), ("c", 1)], 4)


def test_a_member_sends_a_fragment_s_whole_progress_since_its_last_sync_and_trains_on_from_its_own_weights(tmp_path):
    theta = {"a": torch.zeros(3), "b": torch.zeros(2)}
    weights = tmp_path / "weights.safetensors"
    save_named(weights, theta)
    drift, delta = Drift(), tmp_path / "update.safetensors"
    # Round 0 syncs a: its update is what the round trained on a; b's progress drifts on.
    assert drift.base(0, None, weights, tmp_path / "local.safetensors") == weights
    save_named(delta, {"a": torch.full((3,), 1.0), "b": torch.full((2,), 2.0)})
    drift.trained(0, delta, ("a",))
    assert set(load_named(delta)) == {"a"} and torch.equal(load_named(delta)["a"], torch.full((3,), 1.0))
    # Round 1 trains from θ_1 less the drift (b where this member left it), and syncs b: both rounds' progress.
    theta1 = {"a": torch.full((3,), -0.5), "b": torch.zeros(2)}
    save_named(weights, theta1)
    base = drift.base(1, theta1, weights, tmp_path / "local.safetensors")
    local = load_named(base)
    assert torch.equal(local["a"], theta1["a"]) and torch.equal(local["b"], torch.full((2,), -2.0))
    save_named(delta, {"a": torch.full((3,), 0.25), "b": torch.full((2,), 0.5)})
    drift.trained(1, delta, ("b",))
    assert set(load_named(delta)) == {"b"} and torch.equal(load_named(delta)["b"], torch.full((2,), 2.5))
    # A round this node did not follow (it re-synced, skipped one or restarted) trains from θ_r itself.
    assert drift.held(2) and not drift.held(3)
    assert drift.base(3, None, weights, tmp_path / "local.safetensors") == weights
    # The same arithmetic as the in-process simulation's.
    update, carried = streaming_update({"a": torch.ones(1), "b": torch.ones(1)}, {"b": torch.ones(1)}, ("b",))
    assert update == {"b": torch.full((1,), 2.0)} and carried == {"a": torch.ones(1)}
    assert torch.equal(local_weights({"a": torch.ones(1)}, {})["a"], torch.ones(1))


def test_the_outer_step_moves_only_the_round_s_fragment_and_its_momentum_bit_for_bit():
    w = _weights()
    names = fragments([(n, w[n].numel()) for n in sorted(w)], 2)[1]
    numel = sum(w[n].numel() for n in names)
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    outer.buffers = {n: torch.full_like(w[n], 0.01) for n in sorted(w)}
    state = compute.OuterState(round=4, weights=w, outer=outer, work=3)
    mean = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3
    sizes = [w[n].numel() for n in names]
    payloads = compute.split_update({n: t.view(w[n].shape) for n, t in zip(names, torch.split(mean, sizes))}, 2)
    new = compute.apply_aggregates(state, payloads, 5, names=names)
    assert new.round == 5 and new.work == 5
    untouched = [n for n in w if n not in names]
    assert untouched and all(new.weights[n] is w[n] and new.outer.buffers[n] is outer.buffers[n] for n in untouched)
    reference = OuterNesterov(lr=0.7, momentum=0.9)
    reference.buffers = {n: outer.buffers[n].clone() for n in names}
    flat = torch.cat([compute.decode_slice(p, b - a) for p, (a, b) in zip(payloads, compute.slice_bounds(numel, 2))])
    stepped = reference.step({n: w[n] for n in names},
                             {n: t.view(w[n].shape) for n, t in zip(names, torch.split(flat, sizes))})
    assert all(torch.equal(new.weights[n], stepped[n]) and torch.equal(new.outer.buffers[n], reference.buffers[n])
               for n in names)


def test_error_feedback_keeps_each_tensor_s_residual_until_its_fragment_is_sent_again():
    codec = CODECS["int4"]
    a = {"a": torch.linspace(-1, 1, 64)}
    b = {"b": torch.linspace(1, -1, 96)}
    _, residual = compute.fragment_with_feedback(a, 1, codec, None)
    assert set(residual) == {"a"}
    _, residual = compute.fragment_with_feedback(b, 1, codec, residual)
    assert set(residual) == {"a", "b"}
    kept_a = residual["a"].clone()
    payloads, again = compute.fragment_with_feedback(a, 1, codec, residual)
    # a's residual went into this update and was replaced; b's waits for b's next sync.
    assert torch.equal(again["b"], residual["b"]) and not torch.equal(again["a"], kept_a)
    expected, _ = compute.split_with_feedback(a, 1, codec, {"a": kept_a})
    assert payloads == expected


def test_a_spec_asks_for_fragments_within_bounds_and_alone():
    assert tiny_spec().fragments == 1 and task_id(tiny_spec()) == task_id(tiny_spec(fragments=1))
    assert task_id(tiny_spec(fragments=2)) != task_id(tiny_spec())
    assert decode(encode(tiny_spec(fragments=2))).fragments == 2
    for bad, why in ((0, "within 1..16"), (17, "within 1..16")):
        with pytest.raises(ConfigError, match=why):
            tiny_spec(fragments=bad)
    with pytest.raises(ConfigError, match="do not combine"):
        tiny_spec(fragments=2, overlap=0.5)


@pytest.mark.slow
async def test_three_nodes_sync_one_fragment_a_round_and_agree_on_every_round(network, tmp_path, monkeypatch):
    spec = tiny_spec(rounds=4, fragments=2, inner_steps=8)
    tid = task_id(spec)
    changed: dict[str, dict[int, set[str]]] = {}
    apply = Exchange.apply

    async def recording(self, state, job):
        new = await apply(self, state, job)
        if new is not state:
            changed.setdefault(self.me, {})[job.round] = {n for n in state.weights
                                                         if not torch.equal(state.weights[n], new.weights[n])}
        return new

    monkeypatch.setattr(Exchange, "apply", recording)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        nodes = [await swarm.add(n) for n in "abc"]
        await swarm.connected()
        await nodes[0].tasks.publish(spec)
        await wait_until(lambda: all(finished(n, tid) for n in nodes), timeout_s=120)
        runners = [runner(n, tid) for n in nodes]
        for r in range(spec.rounds):
            hashes = {x["weights_hash"] for run in runners for x in run.agreement if x["round"] == r}
            assert len(hashes) == 1, f"round {r}: {hashes}"
        split = [runners[0].fragment(r)[0] for r in range(2)]
        assert set(split[0]) | set(split[1]) == set(runners[0].state.weights) and not set(split[0]) & set(split[1])
        # Each round's outer step moved its fragment, all of it, and nothing else, on every node.
        for me, rounds in changed.items():
            for r, names in rounds.items():
                assert names == set(split[r % 2]), (me, r, sorted(names)[:3])
        losses = [x for _, x in runners[0].eval_losses]
        assert losses[-1] < losses[0], losses
        assert not runners[0].checks.enabled  # members train from their own weights: not what the checks judge
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_late_joiner_takes_the_whole_model_and_its_partial_momentum_and_agrees(network, tmp_path,
                                                                                        monkeypatch):
    # Joining after round 1 the swarm's momentum covers both fragments but has moved each a different number of
    # times; the joiner fetches θ and that momentum, trains from θ_r (no drift of its own yet) and reaches the same
    # weights and state as the others. The first two nodes hold round 2's outer step until it is there.
    spec = tiny_spec(rounds=8, min_members=2, fragments=2)
    tid = task_id(spec)
    joined = trio.Event()
    apply = Exchange.apply

    async def held(self, state, job):
        if job.round >= 2:
            await joined.wait()
        return await apply(self, state, job)

    monkeypatch.setattr(Exchange, "apply", held)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        a, b = [await swarm.add(n) for n in "ab"]
        await swarm.connected()
        await a.tasks.publish(spec)
        await wait_until(lambda: runner(a, tid) is not None and len(runner(a, tid).agreement) >= 2, timeout_s=60)
        c = await swarm.add("c")
        await wait_until(lambda: runner(c, tid) is not None and runner(c, tid).state is not None, timeout_s=60)
        joined.set()
        await wait_until(lambda: all(finished(n, tid) for n in (a, b, c)), timeout_s=90)
        late = runner(c, tid)
        assert late.agreement and all(x["agreed"] for x in late.agreement), late.agreement
        assert late.train_s > 0  # it trained rounds of its own, not only followed
        assert len({runner(n, tid).state.weights_hash() for n in (a, b, c)}) == 1
        assert len({runner(n, tid).state.state_hash() for n in (a, b, c)}) == 1
        nursery.cancel_scope.cancel()
