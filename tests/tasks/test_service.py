"""The task service on real Node objects over the fake network: rounds agree, loss falls, failures are survived."""

from __future__ import annotations

import pytest
import trio

from protocol.task import task_id
from tests.tasks.conftest import Swarm, runner, tiny_spec, wait_until

pytestmark = pytest.mark.slow


def finished(node, tid):
    r = runner(node, tid)
    return r is not None and r.phase == "finished"


async def test_three_nodes_train_together_and_agree_every_round(network, tmp_path):
    spec = tiny_spec(rounds=3)
    tid = task_id(spec)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        nodes = [await swarm.add(n) for n in "abc"]
        await swarm.connected()
        await nodes[0].tasks.publish(spec)
        await wait_until(lambda: all(finished(n, tid) for n in nodes), timeout_s=100)
        runners = [runner(n, tid) for n in nodes]
        for r in range(3):
            hashes = {x["weights_hash"] for run in runners for x in run.agreement if x["round"] == r}
            assert len(hashes) == 1, f"round {r}: {hashes}"
        assert all(x["agreed"] for run in runners for x in run.agreement)
        losses = [x for _, x in runners[0].eval_losses]
        assert losses[-1] < losses[0], losses
        status = nodes[1].status()["task"]
        assert status["id"] == tid and status["round"] == 3 and status["bytes"]["received"] > 0
        print("eval losses", losses)
        nursery.cancel_scope.cancel()
