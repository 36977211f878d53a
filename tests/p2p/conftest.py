"""The p2p contract suite runs every test against the in-memory fake and against real libp2p hosts."""

import pytest

from p2p_harness import Swarm


@pytest.fixture(params=["fake", "libp2p"])
def swarm(request) -> Swarm:
    return Swarm(request.param)
