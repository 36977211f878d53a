"""A producer killed after its update went out, and restarted into that round, announces the same update again.

Retraining the round would sign a second update with other bytes: peers that heard different ones aggregate
different inputs, and the swarm splits for a round (seen in scripts/chaos_swarm.py).
"""

from __future__ import annotations

import json

import pytest
import trio

from node.tasks import exchange, produced, task_files
from protocol.task import task_id
from protocol.task_machine import TaskMachine
from tests.tasks.conftest import Swarm, finished, runner, tiny_spec, wait_until, when_update_sent

ROUND = 1


@pytest.mark.slow
@pytest.mark.parametrize("store_lost_it", [False, True])
async def test_a_producer_restarted_into_a_round_it_sent_its_update_for_sends_the_same_one(network, tmp_path,
                                                                                          monkeypatch, store_lost_it):
    spec = tiny_spec(rounds=4, min_members=3, round_deadline_s=30.0)
    tid = task_id(spec)
    heard: dict[tuple[str, int], set[tuple[str, ...]]] = {}
    hear = TaskMachine._hear_update

    def recording(rec, msg):
        heard.setdefault((msg.producer, msg.round), set()).add(msg.manifest_ids)
        hear(rec, msg)

    monkeypatch.setattr(TaskMachine, "_hear_update", staticmethod(recording))
    # Its peers wait for its slices until it is back (as they do when a restart outlasts no producer grace), so that
    # it restarts into the round it sent its update for rather than one the others closed without it.
    monkeypatch.setattr(exchange, "PRODUCER_GONE_S", 600.0)
    async def die(_):
        network.kill(victim_id)  # right after its update went out, before a peer can fetch a slice of it
        await trio.sleep_forever()

    sent = when_update_sent(monkeypatch, lambda: victim_id, lambda msg: msg.round == ROUND, die)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        nodes = [await swarm.add(n) for n in "abc"]
        victim_id = nodes[2].keypair.peer_id
        await swarm.connected()
        await nodes[0].tasks.publish(spec)
        with trio.fail_after(60):
            await sent.wait()
        task_dir = runner(nodes[2], tid).dir
        swarm.scopes["c"].cancel()
        await wait_until(lambda: victim_id not in network._hosts, timeout_s=10)
        record = task_dir / f"{produced.PREFIX}{ROUND}.json"
        assert record.exists(), "the update's record is on disk before it is announced"
        kept = json.loads(record.read_text())
        if store_lost_it:  # (a power cut before the slices reached the disk): encoded again from the trainer's Δ
            for mid in kept["manifest_ids"]:
                (tmp_path / "c" / "shardcast" / "manifests" / f"{mid}.sealed").unlink()

        back = await swarm.add("c")
        await wait_until(lambda: all(finished(n, tid) for n in [*nodes[:2], back]), timeout_s=120)
        again = runner(back, tid)
        assert heard[(victim_id, ROUND)] == {tuple(kept["manifest_ids"])}, heard[(victim_id, ROUND)]
        assert ROUND not in again._round_train_s, "the restarted node trained its round again"
        # With its slices still in its store, the others may fetch them from the restarted node and close the round
        # before its runner is asked for the round's update; without them, they need the update announced again.
        assert again.updates_resent == 1 if store_lost_it else again.updates_resent <= 1
        runners = [runner(n, tid) for n in [*nodes[:2], back]]
        for r in range(spec.rounds):
            hashes = {x["weights_hash"] for run in runners for x in run.agreement if x["round"] == r}
            assert len(hashes) == 1, f"round {r}: {hashes}"
        nursery.cancel_scope.cancel()


def test_each_round_trains_from_the_inner_state_the_round_before_left(tmp_path):
    assert task_files.inner_opt_paths(tmp_path, 0) == (None, tmp_path / "inner-opt-r0.safetensors")
    legacy = tmp_path / task_files.LEGACY_INNER_OPT
    legacy.write_bytes(b"x")
    assert task_files.inner_opt_paths(tmp_path, 3)[0] == legacy  # a node's state from before the files had rounds
    for r in (2, 3, 5):
        (tmp_path / f"inner-opt-r{r}.safetensors").write_bytes(b"x")
    # Round 5 retrained after a restart reads round 3's state, as its first attempt did, not its own.
    assert task_files.inner_opt_paths(tmp_path, 5) == (tmp_path / "inner-opt-r3.safetensors",
                                                   tmp_path / "inner-opt-r5.safetensors")
    assert not legacy.exists() and not (tmp_path / "inner-opt-r2.safetensors").exists()


def test_a_round_record_is_only_taken_for_its_round_and_base(tmp_path):
    base = "ab" * 32
    produced.save(tmp_path, 4, base_hash=base, samples=48, manifest_ids=["cd" * 32, "ef" * 32], losses=[2.5],
                  shards=[1, 3])
    assert produced.load(tmp_path, 4, base)["manifest_ids"] == ["cd" * 32, "ef" * 32]
    assert produced.load(tmp_path, 4, "12" * 32) is None  # re-synced to other weights: trained afresh
    assert produced.load(tmp_path, 5, base) is None
    (tmp_path / f"{produced.PREFIX}4.json").write_text('{"round": 4, "base_hash": "' + base + '"')
    assert produced.load(tmp_path, 4, base) is None  # torn
    produced.save(tmp_path, 6, base_hash=base, samples=1, manifest_ids=["cd" * 32], losses=[], shards=[])
    assert not (tmp_path / f"{produced.PREFIX}4.json").exists()
