"""Four node processes in their own netlab hosts: a host cut off for 20 s is declared dead, and is back after heal."""

import time

import pytest

from scripts import netlab
from scripts.local_swarm import Swarm
from tests.integration.test_swarm_processes import DEAD_AFTER_S, FAST_ENV, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netlab, pytest.mark.timeout(300)]

CUT_S = 20.0


@pytest.fixture
def lab():
    reason = netlab.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netlab.open_lab(4, rate="50mbit") as lab:
        yield lab


def test_cut_host_goes_dead_and_returns_after_heal(lab, tmp_path):
    swarm = Swarm(4, tmp_path, lab=lab, env=FAST_ENV)
    try:
        swarm.start(watch_interval_s=0.5)
        wait_for(swarm.all_see_all, 90, "every node sees the other three", swarm)
        victim = swarm.nodes[2]
        others = [n for n in swarm.nodes if n is not victim]
        lab.cut(lab.hosts[2].name)
        cut_at = time.monotonic()
        wait_for(lambda: all(n.peers.get(victim.peer_id) == "dead" for n in others), DEAD_AFTER_S + 10,
                 "the others mark the cut host dead", swarm)
        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))  # keep the cut for the full 20 s
        lab.heal(lab.hosts[2].name)
        wait_for(lambda: all(n.peers.get(victim.peer_id) == "alive" for n in others)
                 and set(victim.alive_peers()) == {n.peer_id for n in others},
                 60, "the healed host is alive again in every table", swarm)
        assert victim.proc.poll() is None, "the victim must not have restarted"
    finally:
        swarm.stop()
