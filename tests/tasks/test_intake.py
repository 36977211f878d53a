"""Spec intake under attack: floods of signed specs, failing tasks; the daemon must stay up and bounded."""

from __future__ import annotations

import pytest
import trio

from node.tasks import service as service_module
from node.tasks.runner import TaskRunner
from p2p.api import HostConfig
from p2p.host import open_host
from protocol.envelope import seal
from protocol.keys import Keypair
from protocol.task import SPECS_TOPIC, task_id
from tests.node.conftest import fast_config, start_node
from tests.tasks.conftest import Swarm, start_shardcast, tiny_spec, wait_until


async def test_a_failing_task_is_marked_failed_and_the_daemon_goes_on(network, tmp_path, monkeypatch):
    async def explode(self, sealed, *, task_status=trio.TASK_STATUS_IGNORED):
        raise RuntimeError("trainer exploded")

    monkeypatch.setattr(TaskRunner, "run", explode)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        a, b = await swarm.add("a"), await swarm.add("b")
        await swarm.connected()
        first, second = tiny_spec(name="first"), tiny_spec(name="second")
        await a.tasks.publish(first)
        known = a.tasks.tasks[task_id(first)]
        assert known.decision == "failed" and "trainer exploded" in known.reason
        # The node still runs: it judges the next spec, and its peer still sees it alive.
        await a.tasks.publish(second)
        assert a.tasks.tasks[task_id(second)].decision == "failed"
        await trio.sleep(b.config.dead_after_s)
        assert b.membership.table.alive() == [a.keypair.peer_id]
        shown = a.tasks.summary(task_id(first), known)
        assert shown["decision"] == "failed" and "trainer exploded" in shown["reason"]
        # Its phase says so too, not the step it was in when the error escaped.
        assert shown["phase"] == "failed" and "trainer exploded" in shown["detail"]
        nursery.cancel_scope.cancel()


async def test_thousands_of_distinct_specs_keep_the_task_table_bounded(network, tmp_path, monkeypatch):
    """As if many Sybil initiators each stayed under the flood limit: every spec reaches consider()."""
    started = []

    async def fake_run(self, sealed, *, task_status=trio.TASK_STATUS_IGNORED):
        started.append(self.tid)
        task_status.started()
        await trio.sleep_forever()

    monkeypatch.setattr(TaskRunner, "run", fake_run)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        node = await swarm.add("a")
        service = node.tasks
        for i in range(2_000):
            initiator = Keypair.from_label(f"sybil-{i % 500}")
            spec = tiny_spec(name=f"flood-{i}", seed=i)
            await service.consider(spec, initiator.peer_id, b"sealed")
        assert len(service.tasks) <= service_module.MAX_KNOWN_TASKS + service.options.max_tasks
        assert sum(k.running for k in service.tasks.values()) == service.options.max_tasks
        assert len(started) == service.options.max_tasks
        assert node.traffic.drops["task_forgotten"] >= 2_000 - service_module.MAX_KNOWN_TASKS - 2
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_gossip_flood_of_signed_specs_on_real_libp2p(tmp_path):
    """10,000 distinct, validly signed specs gossiped as fast as one peer can: it is banned, the node is not hurt."""
    from node.tasks import task_service

    async with trio.open_nursery() as nursery:
        calm = dict(heartbeat_interval_s=0.5, suspect_after_s=2.5, dead_after_s=4.0)
        node, _ = await start_node(nursery, fast_config(tmp_path / "node", **calm))
        await start_shardcast(node, nursery)
        await task_service(service_module.TaskOptions(join=False))(node, nursery)
        honest, _ = await start_node(nursery, fast_config(tmp_path / "honest", bootstrap=node.host.listen_addrs(),
                                                          **calm))
        await wait_until(lambda: node.membership.table.alive() == [honest.keypair.peer_id], timeout_s=20)

        flooder_key = Keypair.from_label("spec-flooder")
        async with open_host(flooder_key, HostConfig(listen_addrs=["/ip4/127.0.0.1/tcp/0"])) as flooder:
            await flooder.connect(node.host.listen_addrs()[0])
            with trio.fail_after(20):
                await flooder.wait_for_topic_peer(SPECS_TOPIC, node.keypair.peer_id)
            with trio.move_on_after(120):
                for i in range(10_000):
                    sealed = seal(tiny_spec(name=f"flood-{i}", seed=i), Keypair.from_label(f"init-{i}"))
                    try:
                        await flooder.publish(SPECS_TOPIC, sealed)
                    except Exception:
                        break  # disconnected: banned
                    if i % 100 == 0 and node.membership.is_banned(flooder_key.peer_id):
                        break
            await wait_until(lambda: node.membership.is_banned(flooder_key.peer_id), timeout_s=20)
        assert len(node.tasks.tasks) <= service_module.MAX_KNOWN_TASKS
        assert node.traffic.drops["flood"] >= 1
        seen = node.membership.table.peers[honest.keypair.peer_id].last_seen
        await trio.sleep(node.config.dead_after_s)
        assert node.membership.table.alive() == [honest.keypair.peer_id]
        assert node.membership.table.peers[honest.keypair.peer_id].last_seen > seen
        nursery.cancel_scope.cancel()
