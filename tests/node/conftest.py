"""Helpers to run real Node objects over the in-memory fake network (or real libp2p) in one trio process."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from node.config import NodeConfig
from node.daemon import Node, run_node
from p2p.fake import FakeNetwork

FAST = dict(heartbeat_interval_s=0.2, suspect_after_s=0.6, dead_after_s=1.0, bootstrap_retry_s=0.2,
            hardware_benchmark=False, control_port=0)


def fast_config(data_dir: Path, **overrides) -> NodeConfig:
    values = dict(FAST, data_dir=data_dir, listen=["/ip4/127.0.0.1/tcp/0"])
    values.update(overrides)
    return NodeConfig(**values).validate()


async def start_node(nursery: trio.Nursery, config: NodeConfig, host_factory=None) -> tuple[Node, trio.CancelScope]:
    """Start a node in its own cancel scope, so a test can stop one node and keep the others."""
    scope = trio.CancelScope()

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            kwargs = {} if host_factory is None else {"host_factory": host_factory}
            await run_node(config, task_status=task_status, **kwargs)

    node = await nursery.start(run)
    return node, scope


async def wait_until(predicate, timeout_s: float = 10.0, poll_s: float = 0.02) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(poll_s)


@pytest.fixture
def network() -> FakeNetwork:
    return FakeNetwork()
