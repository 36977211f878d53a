"""A Shoal node that attacks the swarm it trains with, chosen by ``HOSTILE_ATTACK`` (not ``SHOAL_...``: the node
refuses unknown config keys) (``python -m tests.integration.hostile_node start ...``); otherwise it follows
the protocol:

    forge      every aggregate it makes is -10x what its inputs give, stored, hashed and signed as an
               honest aggregate would be, and it never bans anyone (its checks of aggregates are off)
    zeros      every slice of every update it publishes is zeros, its full sample count claimed
    sign_flip  it trains honestly and publishes -10x its update
    gaussian   it trains honestly and publishes its update plus Gaussian noise of 10x the update's rms
    stale      it publishes its first round's update again in every later round
    copy       it trains nothing of its own: each round it waits for another producer's update, fetches its
               slices and publishes them as its own, full samples claimed
    alie       "a little is enough": each round it waits for every other member's update, fetches their slices
               and publishes their mean plus one standard deviation, value by value (inside the honest spread in
               every coordinate), full samples claimed
    overclaim  it trains honestly and claims 10x the samples it trained on (more weight in the mean)
    equivocate every aggregate it makes goes out twice: as made, and with another result over the same
               inputs (each its own lie), and it never bans anyone
    two_updates it trains honestly and signs each update twice: as made, and the same slices published again as
               other manifests (a second update of the round from the same weights, each fetchable and valid)
    silent     it joins and never trains (its own round stays in training): every round it is a member of waits
               for an update that never comes; when the swarm moves on without it, it re-syncs and joins again

Only the trust tests and scripts/bench_byzantine.py start it; nothing in Shoal imports it."""

import dataclasses
import os
import re
import sys

import torch

from node import cli
from node.tasks import compute
from node.tasks.exchange import Exchange
from protocol.audit import Audit
from protocol import task_machine

ATTACKS = ("forge", "zeros", "sign_flip", "gaussian", "stale", "overclaim", "equivocate", "copy", "alie",
           "two_updates", "silent")
ATTACK = os.environ.get("HOSTILE_ATTACK", "")
if ATTACK not in ATTACKS:
    sys.exit(f"hostile_node: HOSTILE_ATTACK must be one of {', '.join(ATTACKS)}, not {ATTACK!r}")

_publish = Exchange._publish_payload
_UPDATE = re.compile(r"/r\d+/u(\d+)$")
_AGGREGATE = re.compile(r"/r\d+/a(\d+)$")
_first: dict[int, bytearray] = {}
_noise = torch.Generator().manual_seed(7)


def _update(self, data, slice_index: int):
    numel = self._slice_numel(slice_index)
    if ATTACK == "zeros":
        return self.codec.encode(torch.zeros(numel))
    if ATTACK == "stale":
        return _first.setdefault(slice_index, bytearray(data))
    x = compute.decode_slice(data, numel, self.codec)
    if ATTACK == "sign_flip":
        return self.codec.encode(-10.0 * x)
    if ATTACK == "gaussian":
        rms = float(x.square().mean().sqrt())
        return self.codec.encode(x + torch.randn(numel, generator=_noise) * (10.0 * rms))
    return data


async def _hostile_publish(self, data, label, version=None, **options):
    update, aggregate = _UPDATE.search(label), _AGGREGATE.search(label)
    if update and ATTACK not in ("forge", "overclaim"):
        data = _update(self, data, int(update.group(1)))
    elif aggregate and ATTACK == "forge":
        numel = self._slice_numel(int(aggregate.group(1)))
        data[:] = self.out.encode(-10.0 * compute.decode_slice(data, numel, self.out))
    return await _publish(self, data, label, version, **options)


Exchange._publish_payload = _hostile_publish


async def _slices_of(self, update, round_: int) -> list[bytearray]:
    """``update``'s slices as sent (fetched, or read from our store)."""
    out = []
    for s, mid in enumerate(update.manifest_ids):
        _, data = await self.exchange._fetch_payload(mid, update.producer, self.exchange._slice_numel(s),
                                                     self.spec.round_deadline_s, kept=self.exchange._slices,
                                                     round_=round_, codec=self.exchange.codec)
        out.append(bytearray(data.numpy().tobytes()))
    return out


async def _as_own(self, update, round_: int, version=None) -> list[str]:
    """``update``'s slices published again under this node's signature: the manifest ids of each."""
    return [await self.exchange.publish_payload(data, f"task/{self.tid[:12]}/r{round_}/u{s}", version=version)
            for s, data in enumerate(await _slices_of(self, update, round_))]


if ATTACK == "overclaim":
    _on_trained = task_machine.TaskMachine._on_Trained
    task_machine._HANDLERS[task_machine.Trained] = lambda self, ev, now: _on_trained(
        self, dataclasses.replace(ev, samples=10 * ev.samples), now)
if ATTACK == "equivocate":
    import hashlib

    from node.tasks.runner import TaskRunner
    from protocol.task import AggregateAnnounce
    _send = TaskRunner._publish

    async def _twice(self, msg):
        await _send(self, msg)
        if isinstance(msg, AggregateAnnounce):
            lie = hashlib.sha256(b"equivocated" + msg.result_hash.encode()).hexdigest()
            await _send(self, dataclasses.replace(msg, result_hash=lie, manifest_id=lie))

    TaskRunner._publish = _twice
if ATTACK == "two_updates":
    from node.tasks.runner import TaskRunner
    from protocol.task import UpdateAnnounce
    _send_update = TaskRunner._publish

    async def _two(self, msg):
        await _send_update(self, msg)
        if isinstance(msg, UpdateAnnounce) and msg.producer == self.me:
            ids = await _as_own(self, msg, msg.round, version=10**9 + msg.round)
            await _send_update(self, dataclasses.replace(msg, manifest_ids=tuple(ids)))

    TaskRunner._publish = _two
if ATTACK == "copy":
    import trio

    from node.tasks.runner import TaskRunner
    from protocol.errors import TransportError
    from protocol.task_machine import Trained

    async def _copy(self, job):
        await self._train(job.round, list(job.members))  # the trainer's clock and state move on as an honest one's
        deadline, tried = trio.current_time() + self.spec.round_deadline_s / 2, set()
        while trio.current_time() < deadline:
            rec = self.machine.rounds_seen.get(job.round)
            for producer, victim in sorted((rec.updates if rec else {}).items()):
                if producer == self.me or producer in tried:
                    continue
                tried.add(producer)
                try:
                    # Whoever has banned this node no longer serves it: copy another.
                    with trio.fail_after(max(0.1, deadline - trio.current_time())):
                        ids = await _as_own(self, victim, job.round)
                except (TransportError, trio.TooSlowError):
                    continue
                shards = tuple(sorted(checks.shards_of(self.tid, job.round, self.me, list(job.members),
                                                       self.spec.dataset.num_shards)))
                return Trained(round=job.round, samples=self.spec.inner_steps * self.spec.batch_size,
                               manifest_ids=tuple(ids), losses=victim.losses, shards=shards)
            await trio.sleep(0.05)
        return await _produce(self, job)  # nobody to copy from this round: an honest update

    from node.tasks import checks
    _produce = TaskRunner._produce
    TaskRunner._produce = _copy
if ATTACK == "alie":
    import trio

    from node.tasks import checks
    from node.tasks.runner import TaskRunner
    from protocol.errors import TransportError
    from protocol.task_machine import Trained

    async def _alie(self, job):
        await self._train(job.round, list(job.members))  # the trainer's clock and state move on as an honest one's
        others = {m for m in job.members if m != self.me}
        deadline = trio.current_time() + self.spec.round_deadline_s / 2
        while True:
            rec = self.machine.rounds_seen.get(job.round)
            heard = {p: u for p, u in sorted((rec.updates if rec else {}).items()) if p in others}
            if len(heard) == len(others) or (len(heard) >= 2 and trio.current_time() > deadline):
                break
            if trio.current_time() > deadline:
                print(f"hostile_node: round {job.round}: {len(heard)} updates heard, an honest one sent",
                      file=sys.stderr, flush=True)
                return await _produce(self, job)  # too few to craft from
            await trio.sleep(0.05)
        try:
            with trio.fail_after(self.spec.round_deadline_s / 2):
                slices = [await _slices_of(self, u, job.round) for u in heard.values()]
        except (TransportError, trio.TooSlowError) as exc:
            print(f"hostile_node: round {job.round}: {exc or 'timed out'}, an honest update sent", file=sys.stderr,
                  flush=True)
            return await _produce(self, job)  # not served (a peer that banned it for another reason)
        ids = []
        for s, values in enumerate(zip(*slices)):
            numel = self.exchange._slice_numel(s)
            stack = torch.stack([compute.decode_slice(v, numel, self.exchange.codec) for v in values])
            crafted = stack.mean(dim=0) + stack.std(dim=0)
            ids.append(await self.exchange.publish_payload(self.exchange.codec.encode(crafted),
                                                           f"task/{self.tid[:12]}/r{job.round}/u{s}", version=job.round))
        shards = tuple(sorted(checks.shards_of(self.tid, job.round, self.me, list(job.members),
                                               self.spec.dataset.num_shards)))
        return Trained(round=job.round, samples=self.spec.inner_steps * self.spec.batch_size,
                       manifest_ids=tuple(ids), losses=next(iter(heard.values())).losses, shards=shards)

    _produce = TaskRunner._produce
    TaskRunner._produce = _alie
if ATTACK == "silent":
    import trio

    from node.tasks.runner import TaskRunner

    async def _never(self, job):
        await trio.sleep_forever()

    TaskRunner._produce = _never
if ATTACK in ("forge", "equivocate"):
    Audit.judge = lambda self, aggregate, accuser=None: []  # it never bans anyone, least of all the honest

if __name__ == "__main__":
    sys.exit(cli.main())
