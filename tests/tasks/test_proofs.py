"""Proofs of forged aggregates from a hostile peer, through the task service: a proof that proves nothing,
or accuses an honest aggregator, costs its sender and bans nobody; the task goes on."""

from __future__ import annotations

import trio

from protocol.envelope import open_sealed, seal
from protocol.keys import Keypair
from protocol.task import AggregateAnnounce, AggregateProof, task_id, task_topic
from tests.tasks.conftest import Swarm, finished, runner, tiny_spec, wait_until


async def test_false_and_malformed_proofs_charge_their_sender_and_ban_nobody(network, tmp_path):
    spec = tiny_spec(rounds=4)
    tid = task_id(spec)
    hostile = Keypair.from_label("false-accuser")
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        nodes = [await swarm.add(n) for n in "abc"]
        await swarm.connected()
        async with network.open_host(hostile) as h:
            await h.connect(nodes[0].host.listen_addrs()[0])
            await nodes[0].tasks.publish(spec)
            await wait_until(lambda: runner(nodes[0], tid) is not None and runner(nodes[0], tid)._sealed_aggregates,
                             timeout_s=60)
            sealed = next(iter(runner(nodes[0], tid)._sealed_aggregates.values()))
            honest = open_sealed(sealed).message
            impostor = AggregateAnnounce(**{**{f: getattr(honest, f) for f in honest.__slots__},
                                            "result_hash": "ee" * 32, "manifest_id": "ee" * 32})
            for inner in (sealed, b"\x00 not an envelope", seal(impostor, hostile)):
                proof = AggregateProof(task_id=tid, accuser=hostile.peer_id, aggregate=inner, result_hash="ee" * 32)
                await h.publish(task_topic(tid), seal(proof, hostile))
            await wait_until(lambda: all(finished(n, tid) for n in nodes), timeout_s=120)
        drops = [n.traffic.drops for n in nodes]
        assert all(d["malformed"] >= 1 and d["impersonation"] >= 1 for d in drops), drops
        assert sum(d["false_accusation"] for d in drops) >= 1, drops
        for node in nodes:
            assert runner(node, tid).machine.audit.banned == set()
            assert not node.membership.is_banned(honest.aggregator)
        hashes = {x["weights_hash"] for n in nodes for x in runner(n, tid).agreement if x["round"] == 3}
        assert len(hashes) == 1
        nursery.cancel_scope.cancel()
