"""A hostile node among real node processes: an aggregator that signs forged results is caught by
every honest node, banned by each, and the honest nodes finish the task on one history."""

import sys
from pathlib import Path

import pytest

from scripts.local_swarm import Swarm
from tests.integration.test_task_processes import ENV, agreed_hashes, started, wait_for

pytestmark = [pytest.mark.slow]

FORGER = Path(__file__).with_name("forging_node.py")
ROUNDS = 6


@pytest.mark.timeout(300)
def test_an_aggregator_that_signs_forged_results_is_banned_by_every_honest_node(tmp_path):
    swarm = Swarm(4, tmp_path, env=ENV)
    forger = swarm.nodes[3]
    forger.argv_prefix = [sys.executable, str(FORGER)]
    honest = swarm.nodes[:3]
    try:
        started(swarm, ROUNDS)
        wait_for(lambda: all(len(agreed_hashes(n)) >= ROUNDS for n in honest), 240, "the honest nodes finish", swarm)
        swarm.update()
        rows = [agreed_hashes(n) for n in honest]
        assert rows[0] == rows[1] == rows[2], "the honest nodes disagree on some round's weights"
        for n in honest:
            assert forger.peer_id in n.status.get("banned_peers", []), (n.index, n.status.get("banned_peers"))
            log = n.log_path.read_text(errors="replace")
            assert f"aggregator {forger.peer_id} signed result" in log, f"node {n.index} never caught the forger"
    finally:
        swarm.stop()
