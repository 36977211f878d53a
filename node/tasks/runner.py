"""One task on one node: join or resume, then DiLoCo rounds over SHARDCAST, driven by the round machine."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import trio

from node.tasks import compute, history
from node.tasks.exchange import Exchange
from node.tasks.hf_task import HFTask, check_trainer
from node.train.client import TrainerCrashed, TrainerRequestFailed, open_trainer
from node.train.data import derive_seed, load_or_build, split_ranges
from node.train.diloco import load_named
from node.train.inner import AdamWConfig
from p2p.api import GossipMessage
from protocol.envelope import Signed, open_sealed, seal
from protocol.errors import ConfigError, RemoteProtocolError, TaskRejected, TransportError
from protocol.rendezvous import assign_shards
from protocol.round import Agreed, Aggregate, Apply, Dissent, Resync, RoundFailed, RoundMachine
from protocol.task import (TASK_MESSAGES, AggregateAnnounce, DatasetOffer, TaskJoin, TaskSpec, UpdateAnnounce,
                           WeightsAnnounce, task_topic)

log = logging.getLogger("shoal.tasks")

MAX_TASK_MESSAGE_BYTES = 64 * 1024
TICK_S = 0.1
MAX_DISSENTS = 32


JOIN_LEAD_ROUNDS = 2
"""A late joiner produces from this many rounds after the one it synced to."""
MAX_STATUS_ROUNDS = 200
"""Per-round history kept in /status: enough for dashboards and the swarm launcher, bounded for long tasks."""


class TaskRunner:
    def __init__(self, node, spec: TaskSpec, tid: str, directory: Path, options):
        self.node, self.spec, self.tid, self.dir, self.options = node, spec, tid, directory, options
        self.me = node.keypair.peer_id
        self.topic = task_topic(tid)
        self.machine = RoundMachine(
            task_id=tid, self_id=self.me, num_slices=spec.aggregation_shards,
            aggregators_per_slice=spec.aggregators_per_shard, round_deadline_s=spec.round_deadline_s,
            max_samples=spec.inner_steps * spec.batch_size, max_members=spec.max_members)
        self.exchange = Exchange(self)
        self.hf = HFTask(self) if spec.hf is not None else None
        """The hf-* recipes' inputs and trainer requests; None for tiny-lm."""
        self.state: compute.OuterState | None = None
        self.phase = "starting"
        self.detail = ""
        self.train_losses: list[tuple[int, float]] = []
        self.agreement: list[dict] = history.load(directory)
        self.eval_losses = [(a["round"], a["eval_loss"]) for a in self.agreement if "eval_loss" in a]
        self.dissents: list[dict] = []
        self.latest_weights: bytes = b""
        self.offer: bytes = b""
        self.corpus_path: Path | None = None
        self._outcomes: dict[int, Any] = {}
        self._verdicts: dict[int, Any] = {}
        self._changed = trio.Event()
        self._bytes_at_start = (0, 0)
        self.observe_rounds: set[int] = set()
        self._hash_of: tuple[int, str] = (-1, "")
        self.train_s = 0.0
        self._round_train_s = 0.0
        """Seconds the trainer child reported training, all rounds together."""
        self.rounds_s = 0.0
        """Wall seconds of the rounds this node took part in, from round start to the weights verdict."""

    # -- status ----------------------------------------------------------------------------------

    def _weights_hash(self) -> str | None:
        # Polled by watchers every fraction of a second: hashing the weights each time would put
        # a full pass over the model on the trio thread, so the hash is kept per state object.
        if self.state is None:
            return None
        if self._hash_of[0] != id(self.state):
            self._hash_of = (id(self.state), self.state.weights_hash())
        return self._hash_of[1]

    def status(self) -> dict:
        stats = self.node.shardcast.statistics()
        r = self.state.round if self.state else None
        return {
            "id": self.tid, "name": self.spec.name, "phase": self.phase, "detail": self.detail,
            "round": r, "rounds": self.spec.rounds,
            "members": self.machine.members(max(self.machine.current, 0)),
            "weights_hash": self._weights_hash(),
            "eval_loss": self.eval_losses[-1][1] if self.eval_losses else None,
            "eval_losses": [[i, round(x, 4)] for i, x in self.eval_losses],
            "agreement": self.agreement[-MAX_STATUS_ROUNDS:], "dissents": self.dissents[-5:],
            "bytes": {"sent": stats.bytes_served - self._bytes_at_start[0],
                      "received": stats.bytes_fetched - self._bytes_at_start[1]},
            "dropped": dict(self.machine.dropped),
            "train_seconds": round(self.train_s, 2), "round_seconds": round(self.rounds_s, 2),
        }

    async def wait_changed(self, timeout_s: float) -> None:
        with trio.move_on_after(timeout_s):
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- gossip ----------------------------------------------------------------------------------

    def validate(self, msg: GossipMessage) -> bool:
        signed = self.node.membership.check_gossip(msg, max_bytes=MAX_TASK_MESSAGE_BYTES, expect=TASK_MESSAGES)
        if signed is None:
            return False
        m = signed.message
        claimed = getattr(m, "peer_id", None) or getattr(m, "producer", None) or getattr(m, "aggregator", None)
        if m.task_id != self.tid or (claimed is not None and claimed != signed.signer):
            self.node.membership.penalize(msg.origin, "impersonation")
            return False
        return True

    async def publish(self, msg: Any) -> bytes:
        sealed = seal(msg, self.node.keypair)
        self.on_signed(Signed(signer=self.me, message=msg, payload=b""))
        try:
            await self.node.host.publish(self.topic, sealed)
            self.node.traffic.messages_out[self.topic] += 1
        except TransportError as exc:
            log.debug("task message not published: %s", exc)
        return sealed

    async def _consume(self, messages) -> None:
        async for msg in messages:
            self.node.traffic.messages_in[self.topic] += 1
            try:
                signed = open_sealed(msg.data, max_bytes=MAX_TASK_MESSAGE_BYTES, expect=TASK_MESSAGES)
            except RemoteProtocolError:
                continue  # judged by the validator
            self.on_signed(signed)

    def on_signed(self, signed: Signed) -> None:
        m, now = signed.message, trio.current_time()
        if isinstance(m, TaskJoin):
            self.machine.on_join(m)
            effects = self.machine.tick(now)
        elif isinstance(m, UpdateAnnounce):
            effects = self.machine.on_update(m, now)
        elif isinstance(m, AggregateAnnounce):
            effects = self.machine.on_aggregate(m, now)
        elif isinstance(m, WeightsAnnounce):
            effects = self.machine.on_weights(m, now)
        else:
            self.exchange.on_offer(m)
            effects = []
        self.dispatch(effects)
        self._notify()

    def dispatch(self, effects) -> None:
        for e in effects:
            if isinstance(e, Aggregate):
                self._nursery.start_soon(self.exchange.aggregate, e)
            elif isinstance(e, (Apply, RoundFailed)):
                self._outcomes[e.round] = e
            elif isinstance(e, (Agreed, Resync)):
                self._verdicts[e.round] = e
            elif isinstance(e, Dissent):
                log.warning("task %s round %d: peer %s announced weights %s, not the majority's",
                            self.tid[:12], e.round, e.peer_id, e.weights_hash[:16])
                self.dissents = (self.dissents + [{"round": e.round, "peer_id": e.peer_id,
                                                   "weights_hash": e.weights_hash}])[-MAX_DISSENTS:]
        if effects:
            self._notify()

    async def _tick(self) -> None:
        while True:
            table = self.node.membership.table.peers
            alive = {p for p, rec in table.items() if rec.state.value != "dead"} | {self.me}
            self.dispatch(self.machine.set_alive(alive, trio.current_time()))
            await trio.sleep(TICK_S)

    async def _announce(self) -> None:
        """Re-gossip the spec and our latest weights, so peers that arrive later can find and join us."""
        while True:
            await trio.sleep(self.options.announce_interval_s)
            for topic, data in ((self.options.specs_topic, self.sealed_spec), (self.topic, self.latest_weights),
                                (self.topic, await self.exchange.current_offer())):
                if data:
                    try:
                        await self.node.host.publish(topic, data)
                    except TransportError:
                        pass

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, sealed_spec: bytes, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.sealed_spec = sealed_spec
        stats = self.node.shardcast.statistics()
        self._bytes_at_start = (stats.bytes_served, stats.bytes_fetched)
        messages = self.node.host.subscribe(self.topic, self.validate)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._consume, messages)
            nursery.start_soon(self._tick)
            nursery.start_soon(self._announce)
            task_status.started()
            try:
                await self._run_task()
            except TaskRejected as exc:
                self.phase, self.detail = "declined", str(exc)
                log.warning("task %s declined: %s", self.tid[:12], exc)
            except (TrainerCrashed, TrainerRequestFailed) as exc:
                self.phase, self.detail = "failed", str(exc)
                log.error("task %s stopped: %s", self.tid[:12], exc)
            # Keep answering (spec, weights, shards) so late peers can still sync to the result.
            await trio.sleep_forever()

    async def _dataset(self) -> Path:
        if self.hf is not None:
            return await self.hf.fetch_inputs()
        cache = self.node.config.data_dir / "tasks" / "corpus"
        ds = self.spec.dataset
        try:
            await trio.to_thread.run_sync(load_or_build, cache, ds.max_bytes, ds.sha256)
        except ConfigError:
            self.phase, self.detail = "fetching dataset", f"local corpus differs from {ds.sha256[:16]}"
            await self.exchange.fetch_dataset(cache / f"{ds.sha256}.corpus")
        return cache / f"{ds.sha256}.corpus"

    async def _run_task(self) -> None:
        self.corpus_path = await self._dataset()
        self.exchange.offer_dataset(self.corpus_path)
        # Start the trainer (a torch import: seconds) before syncing, so a late joiner is ready to
        # train the moment it holds the swarm's weights instead of falling rounds behind.
        async with open_trainer(env=self.options.trainer_env()) as trainer:
            self.trainer = trainer
            check_trainer(self.spec, await trainer.ping())
            if self.hf is not None:
                await self.hf.setup(trainer)
            self.phase = "syncing"
            state = await self._choose_start()
            while state.round < self.spec.rounds:
                self.state = state
                state = await self._round(state)
            self.state = state
        self.phase, self.detail = "finished", f"{self.spec.rounds} rounds"
        log.info("task %s finished: eval losses %s", self.tid[:12], [round(x, 4) for _, x in self.eval_losses])

    async def _wait(self, table: dict, r: int, what: str, timeout_s: float):
        with trio.fail_after(timeout_s):
            while r not in table:
                await self._changed.wait()
        self.detail = ""
        return table.pop(r)

    async def _choose_start(self) -> compute.OuterState:
        """Resume, sync to the swarm's majority weights, or start round 0 once enough peers joined."""
        saved = await trio.to_thread.run_sync(compute.load_checkpoint, self.dir, self.spec)
        listen_until = trio.current_time() + self.options.listen_s
        joined = False
        while True:
            latest = self.machine.latest_majority()
            if latest is not None:
                sync_started_s = trio.current_time()
                state = await self.exchange.sync(latest, saved)
                if state is not None:
                    if state is not saved:
                        self._record_sync(latest, trio.current_time() - sync_started_s)
                    # The swarm may be mid-round already. Join JOIN_LEAD_ROUNDS ahead and only follow
                    # until then, so every member has our TaskJoin before the first round that counts
                    # us: members who disagree on membership pick different aggregators.
                    first = state.round + JOIN_LEAD_ROUNDS
                    self.observe_rounds = set(range(state.round, first))
                    await self.publish(TaskJoin(task_id=self.tid, peer_id=self.me, round=first))
                    return state
            fresh = any(r == 0 for p, r in self.machine.joins.items() if p != self.me)
            if latest is None and (fresh or trio.current_time() >= listen_until):
                if saved is not None and saved.round > 0:
                    return saved  # nobody to ask: continue alone from our own checkpoint
                if not joined:
                    joined = True
                    await self.publish(TaskJoin(task_id=self.tid, peer_id=self.me, round=0))
                members = self.machine.members(0)
                self.detail = f"waiting for members ({len(members)}/{self.spec.min_members})"
                if len(members) >= self.spec.min_members:
                    return saved or await self._initial_state()
            with trio.move_on_after(0.25):
                await self._changed.wait()

    async def _initial_state(self) -> compute.OuterState:
        """θ_0: the seeded init, or the spec's init_manifest fetched over SHARDCAST and checked against the model."""
        if not self.spec.init_manifest:
            return await trio.to_thread.run_sync(compute.new_state, self.spec)
        self.detail = f"fetching the initial weights {self.spec.init_manifest[:16]}"
        try:
            tensors = await self.exchange.fetch_initial(self.spec.init_manifest)
            return await trio.to_thread.run_sync(compute.state_from_initial, self.spec, tensors)
        except (RemoteProtocolError, TransportError, trio.TooSlowError) as exc:
            raise TaskRejected(f"initial weights {self.spec.init_manifest[:16]} unusable: "
                               f"{exc or 'not fetched in time'}") from None

    async def _catch_up(self, r: int) -> compute.OuterState | None:
        """If most members already agreed on the weights after round r or later, fetch those instead
        of running a round the swarm has closed (a slow or late node would only be dropped)."""
        latest = self.machine.latest_majority()
        if latest is None or latest[0] < r:
            return None
        done, _, _, sources = latest
        if 2 * len(sources) <= len(self.machine.members(done)):
            return None  # not a majority yet: the others may still be finishing that round
        started_s = trio.current_time()
        state = await self.exchange.sync(latest, None)
        if state is not None:
            log.info("task %s: the swarm finished round %d already; catching up to round %d", self.tid[:12],
                     done, state.round)
            self._record_sync(latest, trio.current_time() - started_s)
        return state

    def _record_sync(self, latest, seconds: float) -> None:
        """A round this node did not run but took from the majority, in the status history."""
        done, weights_hash, _, sources = latest
        self.eval_losses.append((done, sources[0].eval_loss))
        self.agreement.append({"round": done, "weights_hash": weights_hash[:16], "agreed": True, "caught_up": True,
                               "peers_agreeing": len(sources), "eval_loss": round(sources[0].eval_loss, 4),
                               "members": len(self.machine.members(done)), "round_s": round(seconds, 2),
                               "train_s": 0.0})

    async def _round(self, state: compute.OuterState) -> compute.OuterState:
        r, spec = state.round, self.spec
        caught_up = await self._catch_up(r)
        if caught_up is not None:
            return caught_up
        started_s = trio.current_time()
        producing = r not in self.observe_rounds
        self.phase = f"round {r}: {'training' if producing else 'following'}"
        base_path = self.dir / "weights.safetensors"
        await trio.to_thread.run_sync(compute.save_checkpoint, self.dir, state)
        base_hash = await trio.to_thread.run_sync(state.weights_hash)
        self._round_train_s = 0.0
        self.dispatch(self.machine.start_round(r, base_hash=base_hash, producing=producing, now=trio.current_time()))
        if producing:
            await self._produce(r, base_path, base_hash)
        self.phase = f"round {r}: aggregating"
        outcome = await self._wait(self._outcomes, r, "aggregates", 4 * spec.round_deadline_s)

        new = await self.exchange.apply(state, outcome)
        meta = await trio.to_thread.run_sync(compute.save_checkpoint, self.dir, new)
        eval_loss = await self._evaluate()
        self.eval_losses.append((r, eval_loss))
        state_id = await self.exchange.publish_state(new, f"task/{self.tid[:12]}/state{new.round}")
        announce = WeightsAnnounce(task_id=self.tid, round=r, peer_id=self.me, weights_hash=meta["weights_hash"],
                                   state_hash=meta["state_hash"], state_manifest=state_id, eval_loss=eval_loss)
        self.dispatch(self.machine.finish_round(r, weights_hash=meta["weights_hash"], now=trio.current_time()))
        self.latest_weights = await self.publish(announce)
        self.phase = f"round {r}: comparing weights"
        verdict = await self._wait(self._verdicts, r, "weights majority", 2 * spec.round_deadline_s)
        if isinstance(verdict, Resync):
            log.warning("task %s round %d: our weights %s are not the majority's %s; re-syncing", self.tid[:12], r,
                        meta["weights_hash"][:16], verdict.weights_hash[:16])
            synced = await self.exchange.fetch_state(r + 1, verdict.weights_hash, verdict.state_hash, verdict.sources)
            if synced is not None:
                new = synced
                await trio.to_thread.run_sync(compute.save_checkpoint, self.dir, new)
        round_s = trio.current_time() - started_s
        self.rounds_s += round_s
        new_hash = await trio.to_thread.run_sync(new.weights_hash)
        self.agreement.append({"round": r, "weights_hash": new_hash[:16],
                               "agreed": isinstance(verdict, Agreed),
                               "peers_agreeing": verdict.num_agree if isinstance(verdict, Agreed) else None,
                               "eval_loss": round(eval_loss, 4), "members": len(self.machine.members(r)),
                               "round_s": round(round_s, 2), "train_s": round(self._round_train_s, 2)})
        await trio.to_thread.run_sync(history.record, self.dir, self.agreement)
        log.info("task %s round %d done: eval loss %.4f, weights %s (%s)", self.tid[:12], r, eval_loss,
                 new_hash[:16], "agreed" if isinstance(verdict, Agreed) else "re-synced")
        return new

    async def _produce(self, r: int, base_path: Path, base_hash: str) -> None:
        """Train from θ_r, then publish Δ's int8 slices over SHARDCAST and announce them."""
        result = await self._train(r, base_path)
        self._round_train_s = result.seconds
        self.train_s += result.seconds
        delta = await trio.to_thread.run_sync(load_named, result.out_path)
        payloads = await trio.to_thread.run_sync(compute.split_update, delta, self.spec.aggregation_shards)
        ids = [await self.exchange.publish_payload(p, f"task/{self.tid[:12]}/r{r}/u{s}") for s, p in enumerate(payloads)]
        self.train_losses = result.losses
        await self.publish(UpdateAnnounce(task_id=self.tid, round=r, producer=self.me, base_hash=base_hash,
                                          samples=result.samples, manifest_ids=tuple(ids),
                                          losses=tuple(x for _, x in result.losses[-8:])))

    async def _train(self, r: int, base_path: Path):
        spec = self.spec
        members = self.machine.members(r)
        mine = assign_shards(self.tid, r, members, spec.dataset.num_shards).get(self.me) or \
            [derive_seed(self.tid, r, self.me) % spec.dataset.num_shards]
        if self.hf is not None:
            shard_ranges = self.hf.train_ranges(mine)
        else:
            ranges, _ = split_ranges(self.corpus_path.stat().st_size, spec.dataset.num_shards)
            shard_ranges = [ranges[i] for i in mine]
        a = spec.adamw
        return await self.trainer.train(
            model=self._model_request(), base_path=base_path, data_path=self.corpus_path,
            shard_ranges=shard_ranges, steps=spec.inner_steps, batch_size=spec.batch_size,
            seed=derive_seed(self.tid, r, self.me), out_path=self.dir / "update.safetensors",
            adamw=AdamWConfig(lr=a.lr, beta1=a.beta1, beta2=a.beta2, weight_decay=a.weight_decay,
                              warmup_steps=a.warmup_steps),
            time_budget_s=spec.time_budget_s or None, opt_state_path=self.dir / "inner_opt.safetensors",
            device=self._device())

    async def _evaluate(self) -> float:
        if self.hf is not None:
            heldout = self.hf.heldout_range()
        else:
            _, heldout = split_ranges(self.corpus_path.stat().st_size, self.spec.dataset.num_shards)
        return await self.trainer.evaluate(
            model=self._model_request(), weights_path=self.dir / "weights.safetensors",
            data_path=self.corpus_path, data_range=heldout, num_batches=self.options.eval_batches,
            seed=derive_seed(self.tid, "eval"), batch_size=self.spec.batch_size, device=self._device())

    def _model_request(self):
        return self.hf.model_request() if self.hf is not None else compute.model_config(self.spec)

    def num_params(self) -> int:
        """Values a round exchanges: the hf recipe's trainable tensors, or all of TinyLM."""
        return self.hf.num_params() if self.hf is not None else self.spec.model.num_params()

    def _device(self) -> str:
        """Where the trainer runs the inner steps: a GPU when the task allows one and this node has it.
        Only the outer step must be bit-identical across nodes, and it always runs on the CPU."""
        return {"any": "auto", "cpu": "cpu", "cuda": "cuda"}[self.spec.requirements.device]

