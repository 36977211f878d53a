"""Helpers for the p2p tests: host factories for both implementations and condition waits."""

from __future__ import annotations

import itertools
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator, Callable

import trio

from p2p.api import Host, HostConfig
from p2p.fake import FakeNetwork
from protocol.keys import Keypair

_labels = itertools.count()


def make_config(**overrides) -> HostConfig:
    """Loopback only; short deadlines so a broken test fails fast instead of hanging."""
    values = dict(listen_addrs=["/ip4/127.0.0.1/tcp/0"], dial_timeout_s=5.0, stream_open_timeout_s=5.0,
                  gossip_heartbeat_s=0.5, gossip_degree=4)
    values.update(overrides)
    return HostConfig(**values)


def fresh_keypair() -> Keypair:
    return Keypair.from_label(f"p2p-test-{next(_labels)}")


class Swarm:
    """Opens hosts of one implementation: "fake" (one FakeNetwork per test) or "libp2p"."""

    def __init__(self, kind: str):
        self.kind = kind
        self.network = FakeNetwork() if kind == "fake" else None

    def open_host(self, keypair: Keypair | None = None, config: HostConfig | None = None):
        keypair = keypair or fresh_keypair()
        config = config or make_config()
        if self.network is not None:
            return self.network.open_host(keypair, config)
        from p2p.host import open_host

        return open_host(keypair, config)

    @asynccontextmanager
    async def hosts(self, count: int, config: HostConfig | None = None) -> AsyncIterator[list[Host]]:
        async with AsyncExitStack() as stack:
            yield [await stack.enter_async_context(self.open_host(config=config)) for _ in range(count)]



async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, poll_s: float = 0.01) -> None:
    """Poll a condition that has no event to wait on, failing the test after timeout_s."""
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(poll_s)


async def connect(a: Host, b: Host) -> None:
    assert await a.connect(b.listen_addrs()[0]) == b.peer_id
    await wait_until(lambda: a.peer_id in b.connected_peers())
