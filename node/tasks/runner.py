"""One task on one node: the executor of the task machine's effects, over gossip, SHARDCAST and the trainer.

Every decision is the machine's (protocol/task_machine.py) but the training checks' (node/tasks/checks.py,
handed the updates heard, each round's members and each applied round). This loop feeds the machine each
verified task message, the peer table's last-heard times and the results of the work it asked for, then sleeps
until the next event or ``next_deadline()``. Work (training, aggregation, the outer step, fetching
weights) runs in tasks of its own and reports back as an event, so nothing here blocks a message.
Past 500 lines: one effect executor with one branch per effect type reads best in one place; the
tensor work it calls lives in compute.py and exchange.py, its files in task_files.py, the judging of
aggregates in protocol/audit.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import trio
from safetensors import SafetensorError

from node.tasks import compute, history, produced, task_files
from node.tasks.checks import KEEP_ROUNDS as CHECKED_ROUNDS, TrainingChecks, shards_of
from node.tasks.exchange import Exchange
from node.tasks import fragments
from node.tasks.fragments import Drift
from node.tasks.hf_task import HFTask, check_trainer
from node.tasks.ledger import Ledger
from node.train.client import TrainerCrashed, TrainerRequestFailed, open_trainer
from node.train.data import derive_seed, load_or_build, split_ranges
from node.train.inner import AdamWConfig
from p2p.api import GossipMessage
from protocol.audit import Accused, FalseAccusation, Forged, Verify, open_proof
from protocol.envelope import open_sealed, seal
from protocol.errors import ConfigError, RemoteProtocolError, TaskRejected, TransportError
from protocol.round import Head
from protocol.task import (MAX_CLAIMED_SHARDS, TASK_MESSAGES, AggregateAnnounce, AggregateProof, DatasetOffer,
                           TaskSpec, TrainingProof, UpdateAnnounce, WeightsAnnounce, task_topic)
from protocol.task_machine import (Aggregate, Applied, Apply, Dissent, FetchState, Finished, Impossible, MakeInitial,
                                   Overdue, PeerGone, Publish, RoundClosed, ScreenedOut, Stage, Synced, SyncFailed,
                                   TaskMachine, Train, Trained, WorkFailed)

log = logging.getLogger("shoal.tasks")

CHARGED = {"empty": "empty_update", "opposed": "opposed_update", "outsized": "outsized_update"}
"""Why the screen left a slice out, and what its producer is charged; a duplicate and a one-sided slice are not
charged (node/tasks/robust.py: the screen cannot tell a copy from its original, nor an update crafted to one side
of the median from an honest one that an update crafted around it pushed there)."""
"""What a producer is charged for a slice the screen left out of an applied aggregate (on every node alike);
a duplicate is not charged: nobody can tell the copy from the original."""

MAX_TASK_MESSAGE_BYTES = 64 * 1024
MAX_DISSENTS = 32
MAX_STATUS_ROUNDS = 200
"""Per-round history kept in /status: enough for dashboards and the swarm launcher, bounded for long tasks."""
MAX_TRAINER_RESTARTS = 3
TRAINER_RESTART_WINDOW_S = 600.0
EVENT_QUEUE = 1024
SEALED_AGGREGATES = 4096
"""Aggregates kept as their aggregators sealed them: a forged one is proven with its own signature."""
MAX_FORGERIES = 32


def head_of(state: compute.OuterState | None, peer_id: str = "") -> Head | None:
    if state is None:
        return None
    return Head(round=state.round, weights_hash=state.weights_hash(), state_hash=state.state_hash(),
                work=state.work, peer_id=peer_id)


class TaskRunner:
    def __init__(self, node, spec: TaskSpec, tid: str, directory: Path, options):
        self.node, self.spec, self.tid, self.dir, self.options = node, spec, tid, directory, options
        self.me = node.keypair.peer_id
        self.topic = task_topic(tid)
        cfg = node.config
        self.machine = TaskMachine(
            task_id=tid, self_id=self.me, rounds=spec.rounds, num_slices=spec.aggregation_shards,
            aggregators_per_slice=spec.aggregators_per_shard, round_deadline_s=spec.round_deadline_s,
            quiet_after_s=cfg.suspect_after_s, listen_s=options.listen_s, min_members=spec.min_members,
            max_members=spec.max_members, max_samples=spec.inner_steps * spec.batch_size,
            spot_check=spec.aggregation.spot_check, trainers=frozenset(spec.trainers))
        self.hf = HFTask(self) if spec.hf is not None else None
        """The hf-* recipes' inputs and trainer requests; None for tiny-lm."""
        self.exchange = Exchange(shardcast=node.shardcast, spec=spec, task_id=tid, directory=directory,
                                 keypair=node.keypair, penalize=node.membership.penalize, num_params=self.num_params,
                                 banned=node.membership.is_banned, gone=node.membership.is_gone,
                                 fragment=self.fragment)
        self.checks = TrainingChecks(spec=spec, task_id=tid, me=self.me, fetch_update=self.exchange.fetch_update,
                                     applied_mean=self.exchange.applied_mean,
                                     penalize=node.membership.penalize, publish=self._publish,
                                     corpus=lambda: self.corpus_path,
                                     enabled=self.hf is None or spec.recipe == "hf-causal-lm",
                                     max_bytes=MAX_TASK_MESSAGE_BYTES,
                                     measure=self.hf.gain if self.hf is not None else None,
                                     trainer=lambda: self.trainer, folder=directory)
        """Whether other contributors' updates trained on their own data (tiny-lm and hf-causal-lm tasks)."""
        if self.checks.enabled:
            self.exchange.slices_kept_rounds = CHECKED_ROUNDS
        self.state: compute.OuterState | None = None
        self.phase = "starting"
        self.detail = ""
        self.agreement: list[dict] = history.load(directory)
        """One row per round this node closed or caught up to, kept on disk across restarts."""
        self.eval_losses = [(a["round"], a["eval_loss"]) for a in self.agreement if a.get("eval_loss") is not None]
        self.dissents: list[dict] = []
        self.forgeries: list[dict] = []
        """Aggregates this node found or confirmed forged, their aggregators banned from the task."""
        self.screened_applied: Counter[str] = Counter()
        """Slices the screen left out of the aggregates this node applied, by reason: the same on every node."""
        self._sealed_aggregates: OrderedDict[tuple[int, int, str], bytes] = OrderedDict()
        self.latest_weights: bytes = b""
        self.spec_heard_at = -math.inf
        """When another peer last re-gossiped this task's spec (set by the task service)."""
        self.corpus_path: Path | None = None
        self._send, self._events = trio.open_memory_channel(EVENT_QUEUE)
        self._bytes_at_start = (0, 0)
        self._round_started: dict[int, float] = {}
        self._round_train_s: dict[int, float] = {}
        self._round_ahead: dict[int, int] = {}
        """Per round, the inner steps taken during the previous round's exchange (task option overlap)."""
        self._eval: dict[int, float | None] = {}
        self._history_lock = trio.Lock()
        self.ledger = Ledger(directory, node.keypair, tid, spec.aggregation_shards)
        """The receipts this node sealed for the producers of the rounds it agreed on."""
        self._ledger_lock = trio.Lock()
        self.train_s = 0.0
        """Seconds the trainer child reported training, all rounds together."""
        self.verify_s = 0.0
        """Wall seconds spent recomputing others' aggregates (fetching their inputs included)."""
        self.verifications = 0
        self.trainer = None
        """The trainer child while the task trains (None before it starts and once the task is done)."""
        self._fragments: list[tuple[tuple[str, ...], int]] | None = None
        """The model's fragments and their sizes (task option fragments), worked out once from its layout."""
        self.drift = Drift()
        """This node's progress on the fragments not synced since it trained them (task option fragments)."""
        self.trainer_restarts = 0
        self.updates_resent = 0
        """Rounds this process answered with the update a previous process of this node signed (produced.py)."""
        self._trainer_generation = 0
        self._restart_lock = trio.Lock()
        self._restarted_at: list[float] = []
        self.rounds_s = 0.0
        """Wall seconds of the rounds this node took part in, from round start to the weights verdict."""

    # -- status ----------------------------------------------------------------------------------

    def status(self) -> dict:
        stats = self.node.shardcast.statistics()
        m = self.machine.statistics(trio.current_time())
        return {
            "id": self.tid, "name": self.spec.name, "phase": self.phase, "detail": self.detail or m["detail"],
            "round": self.state.round if self.state else None, "rounds": self.spec.rounds,
            "stage": m["stage"], "work": m["work"], "members": m["members"],
            "weights_hash": self.state.weights_hash() if self.state else None,
            "eval_loss": self.eval_losses[-1][1] if self.eval_losses else None,
            "eval_losses": [[i, round(x, 4)] for i, x in self.eval_losses],
            "agreement": self.agreement[-MAX_STATUS_ROUNDS:], "dissents": self.dissents[-5:],
            "banned": m["banned"], "not_waited": m["not_waited"], "forgeries": self.forgeries[-5:],
            "bytes": {"sent": stats.bytes_served - self._bytes_at_start[0],
                      "received": stats.bytes_fetched - self._bytes_at_start[1]},
            "dropped": m["dropped"],
            "train_seconds": round(self.train_s, 2), "round_seconds": round(self.rounds_s, 2),
            "verify_seconds": round(self.verify_s, 2), "verifications": self.verifications,
            "verify_compute_seconds": round(self.exchange.verify_compute_s, 3),
            "receipts": self.ledger.count, "receipt_errors": self.ledger.errors,
            "screened": dict(self.exchange.screened), "screened_applied": dict(self.screened_applied),
            "training_checks": self.checks.status(),
            "trainer_pid": self.trainer.pid if self.trainer is not None else None,
            "trainer_restarts": self.trainer_restarts,
            "updates_resent": self.updates_resent,
            "peers": self._peer_rows(m),
        }

    def _peer_rows(self, m: dict) -> list[dict]:
        """One row per member (this node included) and per peer heard from lately: its last announced
        round, held-out loss and training share."""
        mine = {"round": self.state.round - 1 if self.state and self.state.round > 0 else None,
                "train_share": self.train_share(), "eval_loss": self.eval_losses[-1][1] if self.eval_losses else None}
        rows = {self.me: mine, **m["announced"]}
        members = set(m["members"])
        return [{"peer_id": p, "self": p == self.me, "member": p in members or p == self.me,
                 "round": r["round"], "eval_loss": None if r["eval_loss"] is None else round(r["eval_loss"], 4),
                 "train_share": None if r["train_share"] is None else round(r["train_share"], 4)}
                for p, r in rows.items()]

    def _set_phase(self) -> None:
        m = self.machine
        if self.phase in ("failed", "declined", "cancelled"):
            return  # final: a step still unwinding under a cancelled scope must not bring the task back to life
        rec = m.rounds_seen.get(m.current)
        if m.stage is Stage.DONE:
            self.phase = "finished"
        elif m.stage is Stage.RUNNING and rec is not None and rec.phase is not None:
            self.phase = f"round {m.current}: {rec.phase.value if rec.producing or rec.phase.value != 'collecting' else 'following'}"
        else:
            self.phase = m.stage.value

    # -- gossip ----------------------------------------------------------------------------------

    def validate(self, msg: GossipMessage) -> bool:
        signed = self.node.membership.check_gossip(msg, max_bytes=MAX_TASK_MESSAGE_BYTES, expect=TASK_MESSAGES)
        if signed is None:
            return False
        m = signed.message
        claimed = getattr(m, "peer_id", None) or getattr(m, "producer", None) or getattr(m, "aggregator", None) \
            or getattr(m, "accuser", None)
        if m.task_id != self.tid or (claimed is not None and claimed != signed.signer):
            self.node.membership.penalize(msg.origin, "impersonation")
            return False
        return True

    async def _publish(self, msg: Any) -> None:
        sealed = seal(msg, self.node.keypair)
        if isinstance(msg, WeightsAnnounce):
            self.latest_weights = sealed
        elif isinstance(msg, UpdateAnnounce):
            # Gossip never brings our own back: the checks hold it as peers do, so that this node, when it is a
            # copy's checker and its own update the original, measures the copy on its batches and can prove it.
            self.checks.heard(msg, sealed)
        try:
            await self.node.host.publish(self.topic, sealed)
            self.node.traffic.messages_out[self.topic] += 1
        except TransportError as exc:
            log.debug("task message not published: %s", exc)

    async def _consume(self, messages) -> None:
        async for msg in messages:
            self.node.traffic.messages_in[self.topic] += 1
            try:
                signed = open_sealed(msg.data, max_bytes=MAX_TASK_MESSAGE_BYTES, expect=TASK_MESSAGES)
            except RemoteProtocolError:
                continue  # judged by the validator
            if signed.signer == self.me:
                continue  # the machine took our own messages into account when it made them
            m = signed.message
            if isinstance(m, DatasetOffer):
                self.exchange.on_offer(m)
            elif isinstance(m, AggregateProof):
                accused = self._accused(m, msg.origin)
                if accused is not None:
                    await self._send.send(accused)
            elif isinstance(m, TrainingProof):
                self.checks.proof(m, msg.origin, self._nursery)
            else:
                if isinstance(m, UpdateAnnounce):
                    self.checks.heard(m, msg.data)
                if isinstance(m, AggregateAnnounce):
                    self._sealed_aggregates[(m.round, m.slice, m.aggregator)] = msg.data
                    while len(self._sealed_aggregates) > SEALED_AGGREGATES:
                        self._sealed_aggregates.popitem(last=False)
                await self._send.send(m)

    def _accused(self, proof: AggregateProof, origin: str) -> Accused | None:
        """The aggregate inside a proof, if its aggregator really signed it for this task; the machine judges
        the rest by recomputing it."""
        opened = open_proof(proof, self.tid, max_bytes=MAX_TASK_MESSAGE_BYTES)
        if isinstance(opened, str):
            self.node.membership.penalize(origin, opened)
            return None
        return opened

    async def _announce(self) -> None:
        """Re-gossip the spec and our latest weights, so peers that arrive later can find and join us.

        The spec is the same bytes from every member: one copy an interval is enough for a newcomer,
        so a member that heard another's copy within the last interval leaves its own out (as Trickle
        does), and a swarm sends about one spec an interval instead of one per member."""
        interval_s = self.options.announce_interval_s
        while True:
            await trio.sleep(interval_s)
            spec = b"" if trio.current_time() - self.spec_heard_at < interval_s else self.sealed_spec
            for topic, data in ((self.options.specs_topic, spec), (self.topic, self.latest_weights),
                                (self.topic, await self.exchange.current_offer())):
                if data:
                    try:
                        await self.node.host.publish(topic, data)
                        self.node.traffic.messages_out[topic] += 1
                    except TransportError:
                        pass

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, sealed_spec: bytes, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.sealed_spec = sealed_spec
        stats = self.node.shardcast.statistics()
        self._bytes_at_start = (stats.bytes_served, stats.bytes_fetched)
        messages = self.node.host.subscribe(self.topic, self.validate)
        self.node.membership.gone_listeners.append(self._peer_gone)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._consume, messages)
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
        finally:
            self.node.membership.gone_listeners.remove(self._peer_gone)

    def _peer_gone(self, peer_id: str) -> None:
        try:
            self._send.send_nowait(PeerGone(peer_id=peer_id))
        except trio.WouldBlock:
            pass  # a full queue: the peer is still found quiet a heartbeat window after its last word

    async def _dataset(self) -> Path:
        if self.hf is not None:
            return await self.hf.fetch_inputs()
        cache = self.node.config.data_dir / "tasks" / "corpus"
        ds = self.spec.dataset
        try:
            await trio.to_thread.run_sync(load_or_build, cache, ds.max_bytes, ds.sha256)
        except ConfigError:
            self.phase, self.detail = "fetching dataset", f"local corpus differs from {ds.sha256[:16]}"
            await self.exchange.fetch_dataset(cache / f"{ds.sha256}.corpus", self.options.dataset_wait_s)
            self.detail = ""
        return cache / f"{ds.sha256}.corpus"

    async def _run_task(self) -> None:
        await self._with_ledger(self.ledger.open)
        self.corpus_path = await self._dataset()
        self.exchange.offer_dataset(self.corpus_path)
        # Start the trainer (a torch import: seconds) before syncing, so a late joiner is ready to
        # train the moment it holds the swarm's weights instead of falling rounds behind.
        async with open_trainer(env=self.options.trainer_env()) as trainer:
            self.trainer = trainer
            check_trainer(self.spec, await trainer.ping())
            if self.hf is not None:
                await self.hf.setup(trainer)  # θ_0's layout, which checkpoints and fetched states are checked against
            self.state = await trio.to_thread.run_sync(task_files.load_checkpoint, self.dir, self.spec)
            if self.spec.fragments > 1:
                await trio.to_thread.run_sync(self._split)
            await self._drive(until_done=True)
        # Finished: the trainer is let go, and the node keeps serving and re-syncing (without evaluating).
        self.trainer = None
        await self._drive(until_done=False)

    def _heard(self) -> dict[str, float]:
        return {p: rec.last_seen for p, rec in self.node.membership.table.peers.items()}

    async def _drive(self, *, until_done: bool) -> None:
        """Feed the machine until it finishes (``until_done``) or for good; TrainerCrashed if work failed."""
        m = self.machine
        now = trio.current_time()
        m.set_heard(self._heard(), now)
        if until_done:
            self._execute(m.start(head_of(self.state, self.me), now))
        while m.stage is not Stage.FAILED and not (until_done and m.stage is Stage.DONE):
            self._set_phase()
            deadline = m.next_deadline()
            event = None
            with trio.move_on_at(deadline if deadline is not None else math.inf):
                event = await self._events.receive()
            now = trio.current_time()
            effects = m.set_heard(self._heard(), now)
            if event is not None:
                effects += m.handle(event, now)
            self._execute(effects)
        if m.stage is Stage.FAILED:
            raise TaskRejected(m.detail) if self.phase == "declined" else TrainerCrashed(m.detail)

    # -- effects ---------------------------------------------------------------------------------

    def _execute(self, effects) -> None:
        for e in effects:
            if isinstance(e, Publish):
                self._nursery.start_soon(self._publish, e.message)
            elif isinstance(e, Train):
                self._round_started.setdefault(e.round, trio.current_time())
                self._nursery.start_soon(self._work, self._produce, e)
            elif isinstance(e, Aggregate):
                self._nursery.start_soon(self._work, self._aggregate, e)
            elif isinstance(e, Verify):
                self._nursery.start_soon(self._work, self._verify, e)
            elif isinstance(e, Forged):
                self._forged(e)
            elif isinstance(e, FalseAccusation):
                log.warning("task %s round %d: %s accused %s of a forged aggregate that recomputes exactly",
                            self.tid[:12], e.aggregate.round, e.accuser, e.aggregate.aggregator)
                self.node.membership.penalize(e.accuser, "false_accusation")
            elif isinstance(e, Apply):
                self._nursery.start_soon(self._work, self._apply, e)
            elif isinstance(e, FetchState):
                log.info("task %s: %s; fetching the weights of round %d from %d peer(s)", self.tid[:12], e.reason,
                         e.head.round, len(e.sources))
                self._nursery.start_soon(self._work, self._fetch_state, e)
            elif isinstance(e, MakeInitial):
                self._nursery.start_soon(self._work, self._make_initial, e)
            elif isinstance(e, RoundClosed):
                self._record_round(e)
            elif isinstance(e, Dissent):
                log.warning("task %s round %d: peer %s announced weights %s, not the vote's", self.tid[:12], e.round,
                            e.peer_id, e.weights_hash[:16])
                self.dissents = (self.dissents + [{"round": e.round, "peer_id": e.peer_id,
                                                   "weights_hash": e.weights_hash}])[-MAX_DISSENTS:]
            elif isinstance(e, Impossible):
                log.warning("task %s round %d: %s %s; it is banned from the task", self.tid[:12], e.round,
                            e.peer_id, e.reason)
                self.node.membership.penalize(e.peer_id, "impossible_message")
            elif isinstance(e, ScreenedOut):
                for producer, why in e.producers:
                    self.screened_applied[why] += 1
                    if why in CHARGED:
                        self.node.membership.penalize(producer, CHARGED[why])
            elif isinstance(e, Overdue):
                log.warning("task %s round %d: %s ran to its deadline waiting for %s", self.tid[:12], e.round,
                            e.phase, ", ".join(p[-8:] for p in e.peers))
            elif isinstance(e, Finished):
                log.info("task %s finished: eval losses %s", self.tid[:12],
                         [round(x, 4) for _, x in self.eval_losses])
        # Phases change with effects; the status reads them between events.
        self._set_phase()

    def _forged(self, e: Forged) -> None:
        a = e.aggregate
        log.warning("task %s round %d: the aggregate of slice %d by %s does not match the updates it lists "
                    "(announced %s, they give %s); %s is banned from the task", self.tid[:12], a.round, a.slice,
                    a.aggregator, a.result_hash[:16], e.result_hash[:16], a.aggregator)
        self.forgeries = (self.forgeries + [{"round": a.round, "slice": a.slice, "aggregator": a.aggregator,
                                             "announced": a.result_hash, "recomputed": e.result_hash,
                                             "found_here": e.prove}])[-MAX_FORGERIES:]
        self.node.membership.penalize(a.aggregator, "forged_aggregate")
        sealed = self._sealed_aggregates.get((a.round, a.slice, a.aggregator))
        if e.prove and sealed is not None:
            self._nursery.start_soon(self._publish, AggregateProof(task_id=self.tid, accuser=self.me, aggregate=sealed,
                                                                   result_hash=e.result_hash))

    async def _work(self, fn, effect) -> None:
        """Run one piece of work; its result (or the trainer's failure) goes back to the machine as an event.

        A trainer child that dies (killed for memory, a crash in torch) is restarted and the work
        done again, up to MAX_TRAINER_RESTARTS in TRAINER_RESTART_WINDOW_S; only then does the task fail."""
        while True:
            generation = self._trainer_generation
            try:
                event = await fn(effect)
            except TrainerCrashed as exc:
                if await self._restart_trainer(generation, exc):
                    continue
                event = WorkFailed(reason=str(exc))
            except TrainerRequestFailed as exc:
                event = WorkFailed(reason=str(exc))
            except TaskRejected as exc:
                self.phase, self.detail = "declined", str(exc)
                log.warning("task %s declined: %s", self.tid[:12], exc)
                event = WorkFailed(reason=str(exc))
            break
        if event is not None:
            await self._send.send(event)

    async def _restart_trainer(self, generation: int, exc: TrainerCrashed) -> bool:
        """Start a fresh trainer child (once for all the work the crash interrupted); False when the
        restart budget is spent or the new child fails too."""
        async with self._restart_lock:
            if self._trainer_generation != generation:
                return True  # another piece of work already restarted it
            now = trio.current_time()
            self._restarted_at = [t for t in self._restarted_at if now - t < TRAINER_RESTART_WINDOW_S]
            if self.trainer is None or len(self._restarted_at) >= MAX_TRAINER_RESTARTS:
                log.error("task %s: %s; not restarting it again (%d restarts in %.0f s)", self.tid[:12], exc,
                          len(self._restarted_at), TRAINER_RESTART_WINDOW_S)
                return False
            self._restarted_at.append(now)
            log.warning("task %s: %s; restarting the trainer", self.tid[:12], exc)
            try:
                await self.trainer.restart()
                check_trainer(self.spec, await self.trainer.ping())
                if self.hf is not None:
                    await self.hf.setup(self.trainer)
            except (TrainerCrashed, TrainerRequestFailed) as again:
                log.error("task %s: the restarted trainer failed too: %s", self.tid[:12], again)
                return False
            self.trainer_restarts += 1
            self._trainer_generation += 1
            return True

    async def _produce(self, job: Train) -> Trained:
        """Train from θ_r, then publish Δ's int8 slices over SHARDCAST; or, restarted into a round whose update
        this node already signed, announce that one again (node/tasks/produced.py)."""
        self.checks.trained(job.round)
        kept = await trio.to_thread.run_sync(produced.load, self.dir, job.round, job.base_hash)
        if kept is not None and await self._resend(job.round, kept):
            log.info("task %s round %d: announcing again the update signed before this node restarted",
                     self.tid[:12], job.round)
            self.updates_resent += 1
            return Trained(round=job.round, samples=kept["samples"], manifest_ids=tuple(kept["manifest_ids"]),
                           losses=tuple(kept["losses"]), shards=tuple(kept["shards"]))
        result = await self._train(job.round, list(job.members))
        self._round_train_s[job.round] = result.seconds
        if result.carried_steps:
            self._round_ahead[job.round] = result.carried_steps
        self.train_s += result.seconds
        part = self.fragment(job.round)
        if part is not None:
            # The round's update is this fragment's progress since its last sync; the rest drifts on.
            await trio.to_thread.run_sync(self.drift.trained, job.round, Path(result.out_path), part[0])
        ids = await self.exchange.publish_update(Path(result.out_path), job.round)
        shards = shards_of(self.tid, job.round, self.me, list(job.members), self.spec.dataset.num_shards)
        trained = Trained(round=job.round, samples=result.samples, manifest_ids=tuple(ids),
                          losses=tuple(x for _, x in result.losses[-8:]),
                          shards=tuple(sorted(shards)) if len(shards) <= MAX_CLAIMED_SHARDS else ())
        # On disk before the machine announces it: whatever kills us from here on, this is our update of the round.
        await trio.to_thread.run_sync(lambda: produced.save(
            self.dir, job.round, base_hash=job.base_hash, samples=trained.samples, manifest_ids=trained.manifest_ids,
            losses=trained.losses, shards=trained.shards))
        return trained

    async def _resend(self, round_: int, kept: dict) -> bool:
        """Whether the slices of the update this node signed for ``round_`` are in the store again: still there, or
        encoded once more from the Δ the trainer left, which gives the same manifests only if it is the same Δ (the
        same residual before it, manifests versioned by round). A second, different update of the round would be
        banned by every peer that hears both."""
        ids = tuple(kept["manifest_ids"])
        if self.exchange.holds_update(round_, ids):
            return True
        try:
            return tuple(await self.exchange.publish_update(self.dir / "update.safetensors", round_)) == ids
        except (OSError, SafetensorError):
            return False  # no Δ left to encode: trained again

    async def _verify(self, job: Verify):
        started = trio.current_time()
        try:
            return await self.exchange.verify(job)
        finally:
            self.verify_s += trio.current_time() - started
            self.verifications += 1

    async def _aggregate(self, job: Aggregate):
        return await self.exchange.aggregate(job)

    async def _apply(self, job: Apply) -> Applied:
        base = self.state
        new = await self.exchange.apply(self.state, job)
        # The state is hashed and stored for joiners (daemon threads) while the trainer evaluates it (the child):
        # both must finish before the weights are announced, neither needs the other. A round followed only to
        # catch up is neither offered to others (the swarm holds later weights, and an announcement without a
        # state manifest is never fetched from) nor evaluated: either would make the catching-up slower than
        # the swarm's rounds, and it would never catch up.
        async def publish() -> str:
            return "" if job.behind else await self.exchange.publish_state(new, f"task/{self.tid[:12]}/state{new.round}")

        eval_loss, state_id = await side_by_side(lambda: self._hold(new, evaluate=not job.behind), publish)
        self._eval[job.round] = eval_loss
        if eval_loss is not None:
            self.eval_losses.append((job.round, eval_loss))
        if job.chosen and not job.behind:
            self.checks.applied(job.round, base, sorted({p for a in job.chosen for p in a.included}), self._nursery,
                                copies=sorted({p for a in job.chosen for p, why in zip(a.screened, a.screened_why)
                                               if why == "duplicate"}))
        return Applied(round=job.round, weights_hash=new.weights_hash(), state_hash=new.state_hash(),
                       state_manifest=state_id, eval_loss=eval_loss, train_share=self.train_share(job.round))

    def train_share(self, open_round: int | None = None) -> float | None:
        """Trainer seconds over the wall seconds of this node's rounds, the open one's so far included;
        None before the node trained."""
        wall = self.rounds_s
        if open_round is not None and open_round in self._round_started:
            wall += trio.current_time() - self._round_started[open_round]
        return min(1.0, self.train_s / wall) if wall > 0 and self.train_s > 0 else None

    async def _hold(self, state: compute.OuterState, *, evaluate: bool) -> float | None:
        """Make ``state`` this node's: its weights file now (the trainer reads θ_r from there), the rest of the
        checkpoint in a thread of its own (task_files.save_weights), then evaluate it (None: not evaluated)."""
        await trio.to_thread.run_sync(task_files.save_weights, self.dir, state)
        eval_loss = await self._evaluate() if evaluate and self.trainer is not None else None
        # Only now: work redone after a trainer restart (_work) must start from the state it started from.
        self.state = state
        return eval_loss

    async def _fetch_state(self, job: FetchState):
        state = await self.exchange.fetch_state(job.head, job.sources, self.state)
        if state is None:
            return SyncFailed(head=job.head, reason="no source delivered matching weights")
        if state is not self.state:
            # Not evaluated: a fetch is how a node catches up, and the swarm does not wait meanwhile.
            await self._hold(state, evaluate=False)
            self.agreement.append({"round": job.head.round - 1, "weights_hash": job.head.weights_hash[:16],
                                   "agreed": True, "caught_up": True, "peers_agreeing": len(job.sources),
                                   "eval_loss": None, "members": len(job.sources) + 1,
                                   "round_s": 0.0, "train_s": 0.0})
            self._record_history()
        return Synced(head=job.head)

    async def _make_initial(self, _job: MakeInitial) -> Synced:
        state = await self._initial_state()
        await trio.to_thread.run_sync(task_files.save_checkpoint, self.dir, state)
        self.state = state
        return Synced(head=head_of(state, self.me))

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
        finally:
            self.detail = ""

    def _record_round(self, e: RoundClosed) -> None:
        now = trio.current_time()
        round_s = now - self._round_started.pop(e.round, now)
        self.rounds_s += round_s
        eval_loss = self._eval.pop(e.round, None)
        self.agreement.append({"round": e.round, "weights_hash": e.weights_hash[:16], "agreed": e.agreed,
                               "peers_agreeing": e.num_agree if e.agreed else None,
                               "eval_loss": None if eval_loss is None else round(eval_loss, 4), "members": e.members,
                               "round_s": round(round_s, 2), "train_s": round(self._round_train_s.pop(e.round, 0.0), 2),
                               **({"steps_ahead": ahead} if (ahead := self._round_ahead.pop(e.round, 0)) else {}),
                               # Wall time, so rounds closed on different nodes (or incarnations) line up.
                               "closed_at": round(time.time(), 3), **({"failed": True} if e.failed else {})})
        self._record_history()
        self.checks.closed(e.round, e.agreed)
        if e.credits:
            self._nursery.start_soon(self._with_ledger, self.ledger.record, e.round, e.weights_hash, e.credits)
        log.info("task %s round %d done: eval loss %s, weights %s (%s)", self.tid[:12], e.round,
                 "-" if eval_loss is None else f"{eval_loss:.4f}", e.weights_hash[:16],
                 "agreed" if e.agreed else "re-syncing")

    def _record_history(self) -> None:
        self._nursery.start_soon(self._save_history)

    async def _save_history(self) -> None:
        # One writer at a time, each writing the rows as they are then: the last write holds them all.
        async with self._history_lock:
            await trio.to_thread.run_sync(history.record, self.dir, list(self.agreement))

    async def _with_ledger(self, fn, *args) -> None:
        # Receipts go to the file in the order rounds close: one writer at a time.
        async with self._ledger_lock:
            try:
                await trio.to_thread.run_sync(fn, *args)
            except OSError as exc:
                log.warning("task %s: the ledger cannot be read (%s); receipts are written once it can",
                            self.tid[:12], exc.strerror or exc)

    # -- the trainer -------------------------------------------------------------------------------

    async def _train(self, r: int, members: list[str]):
        spec = self.spec
        mine = shards_of(self.tid, r, self.me, members, spec.dataset.num_shards)
        if self.hf is not None:
            shard_ranges = self.hf.train_ranges(sorted(mine))  # the order its UpdateAnnounce names, as below
        else:
            ranges, _ = split_ranges(self.corpus_path.stat().st_size, spec.dataset.num_shards)
            # In shard order: the order its UpdateAnnounce names them in, which checkers read them in.
            shard_ranges = [ranges[i] for i in sorted(mine)]
        a = spec.adamw
        processes = self._processes()
        weights = self.dir / "weights.safetensors"
        held = self.state.weights if self.state is not None and self.state.round == r else None
        base = await trio.to_thread.run_sync(self.drift.base, r, held, weights, self.dir / "local.safetensors") \
            if spec.fragments > 1 else weights
        # Steps taken while the exchange runs (not past the last round), carried into the next round.
        overlap = round(spec.overlap * spec.inner_steps) if processes == 1 and r + 1 < spec.rounds else 0
        opt_in, opt_out = await trio.to_thread.run_sync(task_files.inner_opt_paths, self.dir, r)
        return await self.trainer.train(
            model=self._model_request(), base_path=base, data_path=self.corpus_path, shard_ranges=shard_ranges, steps=spec.inner_steps, batch_size=spec.batch_size,
            seed=derive_seed(self.tid, r, self.me), out_path=self.dir / "update.safetensors",
            adamw=AdamWConfig(lr=a.lr, beta1=a.beta1, beta2=a.beta2, weight_decay=a.weight_decay,
                              warmup_steps=a.warmup_steps),
            time_budget_s=spec.time_budget_s or None, opt_state_path=opt_in, opt_state_out=opt_out,
            device=self._device(), processes=processes, shard=self._shard(processes), overlap=overlap,
            carry=spec.overlap > 0)

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

    def fragment(self, round_: int) -> tuple[tuple[str, ...], int] | None:
        """(the tensors round ``round_`` syncs, their values) under the task option fragments; None: the whole
        model."""
        if self.spec.fragments <= 1:
            return None
        self._split()
        return self._fragments[round_ % len(self._fragments)]

    def _split(self) -> None:
        """The model's fragments, once; TaskRejected if it cannot be cut so (fragments.plan)."""
        if self._fragments is None:
            weights = self.state.weights if self.state is not None else compute.initial_weights(self.spec)
            self._fragments = fragments.plan(weights, self.spec.fragments, self.spec.aggregation_shards)

    def num_params(self) -> int:
        """Values a round exchanges: the hf recipe's trainable tensors, or all of TinyLM."""
        return self.hf.num_params() if self.hf is not None else self.spec.model.num_params()

    def _processes(self) -> int:
        """Local ranks for the inner steps: train_processes, or one per CUDA device when the task may use one
        (the trainer child uses fewer when the batch does not split evenly)."""
        if self.node.config.train_processes:
            return self.node.config.train_processes
        if self.spec.requirements.device == "cpu":
            return 1
        devices = ((self.node.hardware_report or {}).get("torch") or {}).get("devices") or []
        return max(1, sum(1 for d in devices if d.get("works") and str(d.get("device", "")).startswith("cuda")))

    def _shard(self, processes: int) -> bool:
        """Whether the local ranks shard the model (FSDP) rather than each holding it: train_sharding, where "auto"
        shards on CUDA when the task's training memory estimate passes 80% of the smallest local GPU."""
        mode = self.node.config.train_sharding
        if processes < 2 or mode == "replicate":
            return False
        if mode == "shard":
            return True
        devices = ((self.node.hardware_report or {}).get("torch") or {}).get("devices") or []
        gpus = [d.get("memory_bytes") or 0 for d in devices
                if d.get("works") and str(d.get("device", "")).startswith("cuda")]
        if self._device() == "cpu" or not gpus or not min(gpus):
            return False
        need = self.spec.memory_estimate_bytes() if self.hf is None else self.hf.info.get("memory_estimate_bytes") or 0
        return need > 0.8 * min(gpus)

    def _device(self) -> str:
        """Where the trainer runs the inner steps: a GPU when the task allows one and this node has it.
        Only the outer step must be bit-identical across nodes, and it always runs on the CPU."""
        return {"any": "auto", "cpu": "cpu", "cuda": "cuda"}[self.spec.requirements.device]


async def side_by_side(*calls):
    """The results of ``calls`` (async callables) run concurrently, in order. When one raises, the others still
    finish, and the exception comes out as itself, not in an ExceptionGroup: _work's handlers must see a trainer
    that died during an evaluation as TrainerCrashed."""
    outcomes: list = [None] * len(calls)

    async def one(i: int) -> None:
        try:
            outcomes[i] = (True, await calls[i]())
        except Exception as exc:  # noqa: BLE001 (re-raised below; Cancelled is no Exception and goes to trio)
            outcomes[i] = (False, exc)

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i)
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]
