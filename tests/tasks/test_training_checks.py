"""Training checks through the task service (node/tasks/checks.py): a member that replays its first update is
measured on its own batches by its checker, proven to every node and banned by all; one that sends another's
update as its own is told from its original by their batches and banned alone; a proof against an honest
producer, or one that proves nothing, costs its sender and bans nobody; a flood of them is measured once and
bans its sender."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import trio

from node.tasks.checks import TrainingChecks, shards_of
from node.tasks.exchange import Exchange
from node.tasks.runner import TaskRunner
from protocol.envelope import open_sealed, seal
from protocol.errors import TransportError
from protocol.keys import Keypair
from protocol.task import TrainingProof, UpdateAnnounce, task_id, task_topic
from protocol.task_machine import Trained
from tests.tasks.conftest import Swarm, finished, runner, tiny_spec, wait_until


def _stale(monkeypatch, peer_id: str) -> None:
    """``peer_id``'s node publishes its first round's update again in every later round (it trains, but what it
    sends is the first round's)."""
    publish, first = Exchange.publish_update, {}

    async def publish_update(self, delta_path, round_):
        if self.me != peer_id:
            return await publish(self, delta_path, round_)
        if not first:
            first["path"] = delta_path.with_name("first-update.safetensors")
            first["path"].write_bytes(delta_path.read_bytes())
        return await publish(self, first["path"], round_)

    monkeypatch.setattr(Exchange, "publish_update", publish_update)


async def _run_with_one_bad(nursery, tmp_path, network, spec, make_bad) -> tuple[list, str]:
    """Four nodes run ``spec`` to the end, the fourth made bad by ``make_bad(its peer id)``: (the three honest nodes,
    the bad one's peer id)."""
    swarm = Swarm(nursery, tmp_path, network)
    nodes = [await swarm.add(n) for n in "abcd"]
    await swarm.connected()
    bad = nodes[3].keypair.peer_id
    make_bad(bad)
    honest = nodes[:3]
    await honest[0].tasks.publish(spec)
    await wait_until(lambda: all(finished(n, task_id(spec)) for n in honest), timeout_s=180)
    return honest, bad


async def test_a_replayed_update_is_found_proven_and_banned_on_every_honest_node(network, tmp_path, monkeypatch):
    spec = tiny_spec(rounds=6, min_members=3, inner_steps=12)
    tid = task_id(spec)
    async with trio.open_nursery() as nursery:
        honest, stale = await _run_with_one_bad(nursery, tmp_path, network, spec,
                                                lambda peer: _stale(monkeypatch, peer))
        await wait_until(lambda: all(n.membership.is_banned(stale) for n in honest), timeout_s=60)
        checks = [runner(n, tid).checks for n in honest]
        status = [c.status() for c in checks]
        print(json.dumps(status))
        # Found by its checkers, proven to the others, and never a finding against an honest producer.
        assert sum(s["untrained"] for s in status) >= 1, status
        assert sum(s["confirmed"] for s in status) >= 1, status
        assert all(s["refuted"] == 0 for s in status), status
        assert {f["producer"] for s in status for f in s["findings"]} == {stale}, status
        assert all(f["gain"] < -0.05 for s in status for f in s["findings"]), status
        # Banned on every honest node; no honest node was charged for its training.
        assert all(n.membership.is_banned(stale) for n in honest)
        assert all(not n.membership.is_banned(m.keypair.peer_id) for n in honest for m in honest)
        assert all(c.strikes.keys() == {stale} for c in checks), [c.strikes for c in checks]
        # Honest updates were checked and passed: the check judges, it does not merely accuse.
        assert sum(s["passed"] for s in status) >= 2, status
        hashes = {x["weights_hash"] for n in honest for x in runner(n, tid).agreement if x["round"] == spec.rounds - 1}
        assert len(hashes) == 1
        nursery.cancel_scope.cancel()


def _copier(monkeypatch, peer_id: str, victims: dict[int, str] | None = None) -> None:
    """``peer_id``'s node publishes, each round, another producer's update as its own (the bytes of its slices, full
    samples claimed): an exact copy, which the screen leaves out with its original. A producer that has banned the
    copier no longer serves it, so it copies whoever still does, and publishes its own update when nobody does."""
    produce = TaskRunner._produce

    async def copy(self, job):
        if self.me != peer_id:
            return await produce(self, job)
        result = await self._train(job.round, list(job.members))
        while True:
            rec = self.machine.rounds_seen.get(job.round)
            others = sorted(p for p in (rec.updates if rec else {}) if p != self.me)
            if others:
                break
            await trio.sleep(0.02)
        for victim in (rec.updates[p] for p in others):
            try:
                slices = [(await self.exchange._fetch_payload(
                    mid, victim.producer, self.exchange._slice_numel(s), 5.0, kept=self.exchange._slices,
                    round_=job.round, codec=self.exchange.codec))[1] for s, mid in enumerate(victim.manifest_ids)]
            except (TransportError, trio.TooSlowError):
                continue
            ids = [await self.exchange.publish_payload(bytearray(data.numpy().tobytes()),
                                                       f"task/{self.tid[:12]}/r{job.round}/u{s}")
                   for s, data in enumerate(slices)]
            samples, losses = self.spec.inner_steps * self.spec.batch_size, victim.losses
            if victims is not None:
                victims[job.round] = victim.producer
            break
        else:
            ids = await self.exchange.publish_update(Path(result.out_path), job.round)
            samples, losses = result.samples, tuple(x for _, x in result.losses[-8:])
        shards = shards_of(self.tid, job.round, self.me, list(job.members), self.spec.dataset.num_shards)
        return Trained(round=job.round, samples=samples, manifest_ids=tuple(ids), losses=losses,
                       shards=tuple(sorted(shards)))

    monkeypatch.setattr(TaskRunner, "_produce", copy)


async def test_a_copied_update_is_told_from_its_original_and_only_the_copier_is_banned(network, tmp_path,
                                                                                        monkeypatch):
    spec = tiny_spec(rounds=6, min_members=3, inner_steps=12)
    tid = task_id(spec)
    async with trio.open_nursery() as nursery:
        honest, copier = await _run_with_one_bad(nursery, tmp_path, network, spec,
                                                 lambda peer: _copier(monkeypatch, peer))
        # Each confirmation fetches the copier's slices first, which can outlast these fast rounds.
        await wait_until(lambda: all(n.membership.is_banned(copier) for n in honest), timeout_s=60)
        status = [runner(n, tid).checks.status() for n in honest]
        print(json.dumps(status))
        findings = [f for s in status for f in s["findings"]]
        # The screen left both out as near copies; the checks named the copier, by the original's batches.
        assert all(runner(n, tid).exchange.screened.keys() <= {"duplicate"} for n in honest)
        assert findings and {f["producer"] for f in findings} == {copier}, status
        assert all(f["copy_of"] in {n.keypair.peer_id for n in honest} and f["advantage"] < -0.02
                   for f in findings), findings
        assert all(s["refuted"] == 0 for s in status), status
        assert all(n.membership.is_banned(copier) for n in honest)
        assert all(not n.membership.is_banned(m.keypair.peer_id) for n in honest for m in honest)
        hashes = {x["weights_hash"] for n in honest for x in runner(n, tid).agreement if x["round"] == spec.rounds - 1}
        assert len(hashes) == 1
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("copies", [1, 12])
async def test_a_false_training_proof_costs_its_sender_and_a_flood_of_them_is_measured_once(network, tmp_path,
                                                                                           monkeypatch, copies):
    # One false proof costs its sender false_accusation and bans nobody; a flood of them (the same accusation with
    # other gains: each a new message) is measured once per node, and every node that measures bans its sender.
    spec = tiny_spec(rounds=5, inner_steps=12)
    tid = task_id(spec)
    hostile = Keypair.from_label("false-checker")
    measured: Counter = Counter()
    measure = TrainingChecks._measure

    async def counting(self, round_, producer, owners, gains, kept):
        measured[(self.me, round_, producer)] += 1
        return await measure(self, round_, producer, owners, gains, kept)

    monkeypatch.setattr(TrainingChecks, "_measure", counting)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        nodes = [await swarm.add(n) for n in "abc"]
        await swarm.connected()
        async with network.open_host(hostile) as h:
            await h.connect(nodes[0].host.listen_addrs()[0])
            await nodes[0].tasks.publish(spec)
            # An honest update of a round the nodes have applied (the second round's, so round 0 is behind them).
            await wait_until(lambda: runner(nodes[0], tid) is not None and any(
                k[0] == 1 for k in runner(nodes[0], tid).checks._sealed), timeout_s=90)
            (_, victim), (update, sealed) = next((k, v) for k, v in runner(nodes[0], tid).checks._sealed.items()
                                                 if k[0] == 1)
            await wait_until(lambda: all(runner(n, tid).state is not None and runner(n, tid).state.round >= 2
                                         for n in nodes), timeout_s=60)
            impostor = seal(UpdateAnnounce(**{f: getattr(update, f) for f in update.__slots__}), hostile)
            for i, inner in enumerate((b"\x00 not an envelope", impostor, *[sealed] * copies)):
                # Each proof its own message: another gain.
                proof = TrainingProof(task_id=tid, accuser=hostile.peer_id, update=inner, gain=-1.0 - i)
                await h.publish(task_topic(tid), seal(proof, hostile))
            await wait_until(lambda: all(finished(n, tid) for n in nodes), timeout_s=120)
        drops = [n.traffic.drops for n in nodes]
        assert all(d["malformed"] >= 1 and d["impersonation"] >= 1 for d in drops), drops
        # Measured again by every node but the victim (which does not judge itself): it trained, so the accuser pays.
        judges = [n for n in nodes if n.keypair.peer_id != victim]
        refuted = [runner(n, tid).checks.counts["refuted"] for n in nodes]
        assert refuted[[n.keypair.peer_id for n in nodes].index(victim)] == 0
        assert all(r >= 1 for n, r in zip(nodes, refuted) if n in judges), refuted
        assert all(d["false_accusation"] >= 1 for n, d in zip(nodes, drops) if n in judges), drops
        # However many proofs, the accused update is measured at most once on each node (once as its checker).
        assert all(measured[(n.keypair.peer_id, 1, victim)] <= 1 for n in nodes), measured
        assert all(n.membership.is_banned(hostile.peer_id) == (copies > 1) for n in judges)
        if copies == 1:
            assert sum(refuted) == len(judges)
        for node in nodes:
            assert not any(node.membership.is_banned(m.keypair.peer_id) for m in nodes)
            assert runner(node, tid).checks.strikes == {}
        assert open_sealed(sealed).message.producer == victim
        hashes = {x["weights_hash"] for n in nodes for x in runner(n, tid).agreement if x["round"] == spec.rounds - 1}
        assert len(hashes) == 1
        nursery.cancel_scope.cancel()


async def test_a_check_that_outlasts_two_rounds_still_tells_a_copy_by_its_original(network, tmp_path, monkeypatch):
    # On a loaded machine a check of fast rounds fetches the update only after the node has applied two more
    # rounds: the round's weights and applied mean it measures by must still be the check's.
    spec = tiny_spec(rounds=6, min_members=3, inner_steps=12)
    tid = task_id(spec)
    fetch, measured_ = Exchange.fetch_update, TrainingChecks._measured
    judged: list[tuple[int, list[str], list[str]]] = []
    copiers: list[str] = []

    async def late(self, update):
        with trio.move_on_after(3):  # the task's last rounds have no two more
            while max(self._applied, default=-1) < update.round + 2:
                await trio.sleep(0.02)
        return await fetch(self, update)

    async def measured(self, round_, producer, others, kept):
        # A node that banned the copier drops its later announcements and no longer fetches from it: nothing to
        # judge, however long the check. Only checks of updates heard before the ban here are counted.
        heard = (round_, producer) in self._sealed and not self.penalize.__self__.is_banned(producer)
        gains = await measured_(self, round_, producer, others, kept)
        if producer in copiers and others and heard:
            judged.append((round_, others, sorted(gains or ())))
        return gains

    monkeypatch.setattr(Exchange, "fetch_update", late)
    monkeypatch.setattr(TrainingChecks, "_measured", measured)
    async with trio.open_nursery() as nursery:
        honest, copier = await _run_with_one_bad(nursery, tmp_path, network, spec,
                                                 lambda peer: (copiers.append(peer), _copier(monkeypatch, peer)))
        await wait_until(lambda: not any(r.checks._running for r in (runner(n, tid) for n in honest)), timeout_s=60)
        early = [j for j in judged if j[0] < spec.rounds - 2]
        assert early, judged
        # Each was measured against the original's batches, by the weights and mean of its own round.
        unmeasured = [j for j in judged if not set(j[1]) <= set(j[2])]
        assert not unmeasured, unmeasured
        findings = [f for n in honest for f in runner(n, tid).checks.findings]
        assert {f["producer"] for f in findings} == {copier} and all(f["copy_of"] for f in findings), findings
        assert all(not n.membership.is_banned(m.keypair.peer_id) for n in honest for m in honest)
        nursery.cancel_scope.cancel()


async def test_a_node_holds_its_own_update_to_judge_a_copy_of_it_on_its_own_batches(network, tmp_path, monkeypatch):
    # Gossip never brings a node its own update back. The original, as a copy's checker (when a slice of the copy
    # was not fetched, the original is a contributor) or handed a peer's proof, must hold its own update to
    # measure the copy on its own batches.
    spec = tiny_spec(rounds=5, min_members=3, inner_steps=12)
    tid = task_id(spec)
    measured_ = TrainingChecks._measured
    by_original: list[tuple[int, str, list[str]]] = []
    copiers: list[str] = []

    async def measured(self, round_, producer, others, kept):
        gains = await measured_(self, round_, producer, others, kept)
        if producer in copiers and self.me in others:
            by_original.append((round_, self.me, sorted(gains or ())))
        return gains

    monkeypatch.setattr(TrainingChecks, "_measured", measured)
    async with trio.open_nursery() as nursery:
        honest, copier = await _run_with_one_bad(nursery, tmp_path, network, spec,
                                                 lambda peer: (copiers.append(peer), _copier(monkeypatch, peer)))
        await wait_until(lambda: all(n.membership.is_banned(copier) for n in honest), timeout_s=60)
        await wait_until(lambda: not any(r.checks._running for r in (runner(n, tid) for n in honest)), timeout_s=60)
        assert by_original, "no original measured its copier"
        assert all(me in gains for _, me, gains in by_original), by_original
        for n in honest:
            checks = runner(n, tid).checks
            me = n.keypair.peer_id
            assert all((r, me) in checks._sealed for r in checks._bases), (me, list(checks._sealed))
        nursery.cancel_scope.cancel()


def test_only_updates_within_the_steps_the_margin_was_measured_at_are_judged():
    from node.tasks import training_check
    assert not training_check.judged(training_check.CHECK_MIN_STEPS - 1)
    assert training_check.judged(training_check.CHECK_MIN_STEPS) and training_check.judged(training_check.CHECK_MAX_STEPS)
    # Hundreds of steps at a high rate made honest updates fail the check (the netlab partition test): not judged.
    assert not training_check.judged(training_check.CHECK_MAX_STEPS + 1) and not training_check.judged(2000)


async def test_an_update_measured_again_against_another_producer_is_not_fetched_again(tmp_path, monkeypatch):
    # A peer's proof that the update copied a producer this node did not measure it against comes after the first
    # check, when the update's slices may be released everywhere: the update as first fetched is measured again,
    # until its round is no longer kept.
    import torch

    from node.tasks import compute
    spec = tiny_spec(inner_steps=12)
    tid = task_id(spec)
    state = compute.new_state(spec)
    numel = sum(t.numel() for t in state.weights.values())
    fetched: list[str] = []

    async def fetch(update):
        fetched.append(update.producer)
        return torch.zeros(numel)

    async def gains_on(self, base, delta, corpus, round_, producer, own, batches, reference):
        return {o: (0.1 if o == producer else 0.05) for o in batches}, 0.001

    monkeypatch.setattr(TrainingChecks, "_gains_on", gains_on)
    checks = TrainingChecks(spec=spec, task_id=tid, me=Keypair.from_label("me").peer_id, fetch_update=fetch,
                            applied_mean=lambda r: lambda: torch.zeros(numel), penalize=lambda *_: None,
                            publish=None, corpus=lambda: tmp_path, enabled=True, max_bytes=1 << 20)
    copier, original = (Keypair.from_label(x).peer_id for x in ("copier", "original"))
    for i, producer in enumerate((copier, original)):
        checks.heard(UpdateAnnounce(task_id=tid, round=0, producer=producer, base_hash=state.weights_hash(),
                                    samples=12 * spec.batch_size, manifest_ids=("ab" * 32,), losses=(), shards=(i,)),
                     b"sealed")
    async with trio.open_nursery() as nursery:
        checks.trained(0)
        checks.applied(0, state, [copier, original], nursery)  # this node contributed nothing: it checks nobody
    first = await checks._measured(0, copier, [], checks._bases[0])
    again = await checks._measured(0, copier, [original], checks._bases[0])
    assert first == {copier: 0.1} and again == {copier: 0.1, original: 0.05}
    assert fetched == [copier]
    for r in (1, 2, 3):
        checks.trained(r)
        async with trio.open_nursery() as nursery:
            checks.applied(r, state, [copier, original], nursery)
    assert not checks._updates  # gone with its round


async def test_an_update_naming_a_shard_the_task_does_not_have_is_not_judged_and_stops_nothing(tmp_path, monkeypatch):
    # A message may name shards up to the protocol's cap; a task has fewer. A hostile producer that names one past
    # the task's must leave its update unjudged, not raise out of the check into the task.
    import torch

    from node.tasks import compute
    from node.train.data import build_corpus
    spec = tiny_spec(inner_steps=12)
    tid = task_id(spec)
    state = compute.new_state(spec)
    numel = sum(t.numel() for t in state.weights.values())
    corpus = tmp_path / "corpus"
    corpus.write_bytes(build_corpus(spec.dataset.max_bytes))

    async def fetch(update):
        return torch.zeros(numel)

    checks = TrainingChecks(spec=spec, task_id=tid, me=Keypair.from_label("me").peer_id, fetch_update=fetch,
                            applied_mean=lambda r: lambda: torch.zeros(numel), penalize=lambda *_: None,
                            publish=None, corpus=lambda: corpus, enabled=True, max_bytes=1 << 20)
    hostile = Keypair.from_label("hostile").peer_id
    checks.heard(UpdateAnnounce(task_id=tid, round=0, producer=hostile, base_hash=state.weights_hash(),
                                samples=12 * spec.batch_size, manifest_ids=("ab" * 32,), losses=(),
                                shards=(spec.dataset.num_shards,)), b"sealed")
    async with trio.open_nursery() as nursery:
        checks.trained(0)
        checks.applied(0, state, [hostile], nursery)
    assert await checks._measured(0, hostile, [], checks._bases[0]) is None
