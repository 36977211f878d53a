"""Real node processes on loopback: they find each other, notice a SIGKILL, and stop cleanly on SIGTERM."""

import signal
import time

import pytest

from scripts.local_swarm import Swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DEAD_AFTER_S = 5.0
FAST_ENV = {"SHOAL_HEARTBEAT_INTERVAL_S": "1", "SHOAL_SUSPECT_AFTER_S": "3", "SHOAL_DEAD_AFTER_S": str(DEAD_AFTER_S),
            "SHOAL_HARDWARE_BENCHMARK": "false"}


def wait_for(predicate, timeout_s: float, what: str, swarm: Swarm) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}; tables: "
                                 f"{[n.peers for n in swarm.nodes]}")
        swarm.update()
        time.sleep(0.1)
    return time.monotonic() - start


def test_four_nodes_see_each_other_notice_sigkill_and_stop_on_sigterm(tmp_path):
    swarm = Swarm(4, tmp_path, env=FAST_ENV)
    try:
        swarm.start(watch_interval_s=0.2)
        ids = [n.peer_id for n in swarm.nodes]
        wait_for(swarm.all_see_all, 60, "every node sees the other three", swarm)

        victim, survivors = swarm.nodes[3], swarm.nodes[:3]
        victim.proc.send_signal(signal.SIGKILL)
        # The watchers poll every 0.2 s; the peer table ticks every heartbeat (1 s).
        took_s = wait_for(lambda: all(n.peers.get(victim.peer_id) == "dead" for n in survivors),
                          DEAD_AFTER_S + 5.0, "the survivors mark the killed node dead", swarm)
        assert took_s <= DEAD_AFTER_S + 5.0
        assert all(set(n.alive_peers()) == set(ids[:3]) - {n.peer_id} for n in survivors)

        leaver = swarm.nodes[2]
        started = time.monotonic()
        leaver.proc.send_signal(signal.SIGTERM)
        assert leaver.proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5.0
    finally:
        swarm.stop()
    assert [n.exit_code for n in swarm.nodes[:3]] == [0, 0, 0]
    assert swarm.nodes[3].exit_code == -signal.SIGKILL
