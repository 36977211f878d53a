"""Swarms of real Node objects with SHARDCAST and the task service, over the in-memory fake network."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio

from node.daemon import run_node
from node.shardcast import ShardcastConfig, ShardcastService, ShardStore
from node.tasks import TaskOptions, task_service
from node.train.data import build_corpus, corpus_id
from p2p.fake import FakeNetwork
from protocol.spec_toml import spec_from_dict
from tests.node.conftest import fast_config, wait_until

CORPUS_BYTES = 96 * 1024
SHARDCAST_FAST = dict(shard_bytes=64 * 1024, have_interval_s=0.02, busy_retry_s=0.1, failure_backoff_s=0.3,
                      query_interval_s=0.2, stall_timeout_s=10.0, inactivity_s=3.0)
OPTIONS = dict(announce_interval_s=0.3, listen_s=0.6, dataset_wait_s=5.0, eval_batches=4)

_corpus_sha = {}


def corpus_sha(max_bytes: int = CORPUS_BYTES) -> str:
    if max_bytes not in _corpus_sha:
        _corpus_sha[max_bytes] = corpus_id(build_corpus(max_bytes))
    return _corpus_sha[max_bytes]


def tiny_spec(**overrides):
    fields = dict(
        name="tiny-test", inner_steps=8, batch_size=8, rounds=3, round_deadline_s=20.0, min_members=3,
        max_members=8, aggregation_shards=2, seed=7, created_ms=1,
        model=dict(n_layer=1, n_head=2, d_model=32, seq_len=32),
        dataset=dict(kind="stdlib-corpus", max_bytes=CORPUS_BYTES, sha256=corpus_sha(), num_shards=6),
        adamw=dict(lr=3e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, warmup_steps=0),
    )
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(fields.get(key), dict):
            fields[key] = {**fields[key], **value}
        else:
            fields[key] = value
    return spec_from_dict(fields)


async def start_shardcast(node, nursery: trio.Nursery) -> None:
    store = await trio.to_thread.run_sync(ShardStore.open, node.config.data_dir / "shardcast")
    node.shardcast = ShardcastService(node.host, node.keypair, store, penalize=node.membership.penalize,
                                      config=ShardcastConfig(**SHARDCAST_FAST))
    await nursery.start(node.shardcast.run)


class Swarm:
    def __init__(self, nursery: trio.Nursery, tmp_path: Path, network: FakeNetwork):
        self.nursery, self.tmp_path, self.network = nursery, tmp_path, network
        self.nodes: dict[str, object] = {}
        self.scopes: dict[str, trio.CancelScope] = {}

    async def add(self, name: str, **options) -> object:
        boot = [next(iter(self.nodes.values())).host.listen_addrs()[0]] if self.nodes else []
        config = fast_config(self.tmp_path / name, bootstrap=boot)
        opts = TaskOptions(**{**OPTIONS, **options})
        scope = trio.CancelScope()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await run_node(config, services=[start_shardcast, task_service(opts)],
                               host_factory=self.network.open_host, task_status=task_status)

        node = await self.nursery.start(run)
        self.nodes[name], self.scopes[name] = node, scope
        return node

    async def connected(self, timeout_s: float = 10.0) -> None:
        nodes = list(self.nodes.values())
        ids = {n.keypair.peer_id for n in nodes}
        await wait_until(lambda: all(set(n.membership.table.alive()) >= ids - {n.keypair.peer_id} for n in nodes),
                         timeout_s=timeout_s)


def when_update_sent(monkeypatch, producer, when, then) -> trio.Event:
    """Patch every runner's gossip: once ``producer()``'s runner has published an UpdateAnnounce for which
    ``when(msg)`` holds, the returned event is set and ``await then(runner)`` runs in that publish, before anything
    else can."""
    from node.tasks.runner import TaskRunner
    from protocol.task import UpdateAnnounce
    sent = trio.Event()
    publish = TaskRunner._publish

    async def publishing(self, msg):
        await publish(self, msg)
        if isinstance(msg, UpdateAnnounce) and self.me == producer() and not sent.is_set() and when(msg):
            sent.set()
            await then(self)

    monkeypatch.setattr(TaskRunner, "_publish", publishing)
    return sent


def runner(node, tid):
    known = node.tasks.tasks.get(tid)
    return None if known is None else known.runner


def finished(node, tid):
    r = runner(node, tid)
    return r is not None and r.phase == "finished"


@pytest.fixture
def network() -> FakeNetwork:
    return FakeNetwork()


__all__ = ["Swarm", "corpus_sha", "dataclasses", "finished", "runner", "tiny_spec", "wait_until", "when_update_sent"]
