"""A node serves one state: the one before goes once no peer fetches it; a joiner that asks after is told at once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trio

from p2p.fake import FakeNetwork

from node.shardcast import ShardcastConfig
from node.tasks import compute
from node.tasks.exchange import Exchange
from node.tasks.runner import head_of
from tests.shardcast.conftest import FAST, Swarm, wait_until
from tests.tasks.conftest import tiny_spec

TASK = "ab" * 32


@pytest.fixture
async def swarm(nursery, tmp_path):
    yield Swarm(nursery, tmp_path, FakeNetwork())


def exchange_of(node, spec, tmp_path) -> Exchange:
    return Exchange(shardcast=node.service, spec=spec, task_id=TASK, directory=tmp_path / node.name,
                    keypair=node.keypair, penalize=lambda peer, why: None, num_params=lambda: 0)


def next_state(state: compute.OuterState) -> compute.OuterState:
    return compute.OuterState(round=state.round + 1, weights={n: t + 1e-3 for n, t in state.weights.items()},
                              outer=state.outer, work=state.work + 1)


async def test_a_joiner_asking_for_replaced_weights_fails_at_once_and_takes_the_newer_ones(swarm, tmp_path):
    # The store's stall timeout (FAST: 20 s) is what a fetch of released weights used to wait out, per source.
    config = ShardcastConfig(**{**FAST, "serving_grace_s": 1.0})
    spec = tiny_spec()
    a, b = await swarm.add("a", config=config), await swarm.add("b", config=config)
    member, joiner = exchange_of(a, spec, tmp_path), exchange_of(b, spec, tmp_path)
    old = compute.new_state(spec)
    new = next_state(old)
    with trio.fail_after(30):
        old_head = dataclasses.replace(head_of(old, a.peer_id),
                                       state_manifest=await member.publish_state(old, "task/state0"))
        new_head = dataclasses.replace(head_of(new, a.peer_id),
                                       state_manifest=await member.publish_state(new, "task/state1"))
        # Nobody was fetching the old state: it went as the new one was published.
        await wait_until(lambda: a.store.get_manifest(bytes.fromhex(old_head.state_manifest)) is None)
        assert a.store.manifest_ids() == [bytes.fromhex(new_head.state_manifest)]
        started = trio.current_time()
        assert await joiner.fetch_state(old_head, (old_head,), None) is None
        assert trio.current_time() - started < 2.0
        got = await joiner.fetch_state(new_head, (new_head,), None)
    assert got is not None and got.weights_hash() == new.weights_hash() and got.state_hash() == new.state_hash()
    assert all(torch.equal(got.weights[n], new.weights[n]) for n in new.weights)


async def test_a_source_that_cannot_be_reached_is_passed_over_at_once_for_one_that_holds_the_same_weights(swarm,
                                                                                                          tmp_path):
    # After a partition heals, the first member a node hears may sit behind a connection that died with the cut;
    # asking it for the weights used to wait out the round deadline (20 s here) before the next source was tried.
    spec = tiny_spec()
    a, b, joiner_node = await swarm.add("a"), await swarm.add("b"), await swarm.add("c")
    state = next_state(compute.new_state(spec))
    heads = []
    with trio.fail_after(30):
        for node in (a, b):
            mid = await exchange_of(node, spec, tmp_path).publish_state(state, f"task/state1-{node.name}")
            heads.append(dataclasses.replace(head_of(state, node.peer_id), state_manifest=mid))
        swarm.network.partition(a.peer_id, joiner_node.peer_id)
        started = trio.current_time()
        got = await exchange_of(joiner_node, spec, tmp_path).fetch_state(heads[0], tuple(heads), None)
    assert trio.current_time() - started < 2.0
    assert got is not None and got.weights_hash() == state.weights_hash() and got.state_hash() == state.state_hash()


async def test_aggregates_go_once_more_rounds_behind_than_a_joiner_would_follow_however_long_the_deadline(swarm,
                                                                                                         tmp_path):
    # Short rounds under a long deadline used to keep every aggregate of the last two deadlines.
    from node.tasks.exchange import AGGREGATE_RETENTION_ROUNDS
    from protocol.task_machine import AHEAD_ROUNDS
    node = await swarm.add("a")
    exchange = exchange_of(node, tiny_spec(), tmp_path)
    assert exchange.aggregate_retention_s >= 40.0  # two deadlines of the spec: longer than this whole test
    released = []

    async def release(ids, **kwargs):
        released.extend(ids)

    node.service.release = release
    with trio.fail_after(30):
        for r in range(30):
            exchange._aggregates.setdefault(r, set()).add(r.to_bytes(32, "big"))
            await exchange.collect(r)
            kept = sorted(exchange._aggregates)
            # A joiner follows at most AHEAD_ROUNDS rounds: every aggregate it could need is still here.
            assert kept[0] <= max(0, r - AHEAD_ROUNDS) and kept == list(range(kept[0], r + 1))
            assert len(kept) <= AGGREGATE_RETENTION_ROUNDS + 1
    assert sorted(int.from_bytes(i, "big") for i in released) == list(range(30 - len(kept)))
