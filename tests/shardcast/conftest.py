"""Shardcast test swarms on the in-memory FakeNetwork: nodes that can be stopped, killed and restarted."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from p2p.fake import FakeNetwork
from protocol.keys import Keypair

from node.shardcast import ShardcastConfig, ShardcastService, ShardStore

FAST = dict(shard_bytes=16 * 1024, have_interval_s=0.01, busy_retry_s=0.2, failure_backoff_s=0.5,
            query_interval_s=0.3, stall_timeout_s=20.0, inactivity_s=3.0)


@dataclass
class Node:
    name: str
    keypair: Keypair
    data_dir: Path
    host: object = None
    service: ShardcastService = None
    store: ShardStore = None
    penalties: list = field(default_factory=list)
    _scope: trio.CancelScope = None
    _stopped: trio.Event = None

    @property
    def peer_id(self) -> str:
        return self.keypair.peer_id

    async def stop(self) -> None:
        self._scope.cancel()
        await self._stopped.wait()


class Swarm:
    def __init__(self, nursery: trio.Nursery, tmp_path: Path, network: FakeNetwork):
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.network = network
        self.nodes: list[Node] = []
        self._ids = itertools.count()

    async def add(self, name: str | None = None, *, config: ShardcastConfig | None = None,
                  data_dir: Path | None = None, connect: bool = True) -> Node:
        name = name or f"n{next(self._ids)}"
        node = Node(name=name, keypair=Keypair.from_label(name), data_dir=data_dir or self.tmp_path / name)
        await self.nursery.start(self._run, node, config or ShardcastConfig(**FAST))
        if connect:
            for other in self.nodes:
                if other is not node and other.host is not None and other._scope and not other._stopped.is_set():
                    await node.host.connect(other.host.listen_addrs()[0])
        if node not in self.nodes:
            self.nodes.append(node)
        return node

    async def _run(self, node: Node, config: ShardcastConfig, task_status=trio.TASK_STATUS_IGNORED) -> None:
        node._stopped = trio.Event()
        try:
            with trio.CancelScope() as node._scope:
                node.store = await trio.to_thread.run_sync(ShardStore.open, node.data_dir)
                async with self.network.open_host(node.keypair) as host:
                    node.host = host
                    node.service = ShardcastService(host, node.keypair, node.store,
                                                    penalize=lambda p, r: node.penalties.append((p, r)),
                                                    config=config)
                    async with trio.open_nursery() as inner:
                        await inner.start(node.service.run)
                        task_status.started()
                        await trio.sleep_forever()
        finally:
            node._stopped.set()


@pytest.fixture
async def swarm(nursery, tmp_path):
    yield Swarm(nursery, tmp_path, FakeNetwork())


async def wait_until(predicate) -> None:
    """Poll a condition at a fine grain; callers bound it with trio.fail_after."""
    while not predicate():
        await trio.sleep(0.005)
