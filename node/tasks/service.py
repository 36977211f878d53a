"""The task service: hear signed task specs, judge them, join or decline, run each joined task; control routes."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import trio

from node.control import HttpError, Request, Response
from node.fsutil import remove_stale_temps, write_atomic
from node.tasks.cancel import Cancels
from p2p.api import GossipMessage
from protocol.envelope import open_sealed, seal
from protocol.scores import FloodLimiter
from protocol.errors import ConfigError, RemoteProtocolError, TaskRejected, TransportError
from protocol.spec_toml import load_spec_toml, spec_from_dict, spec_to_dict
from protocol.task import DEFAULT_TASK_SPEC_BYTES, KNOWN_RECIPES, SPECS_TOPIC, TaskCancel, TaskSpec, task_id

log = logging.getLogger("shoal.tasks")

MAX_KNOWN_TASKS = 256
"""Declined and finished tasks remembered (so a re-gossiped spec is not judged again); oldest forgotten first."""
MIN_KEEP_MANIFESTS = 256
"""Rounds publish and fetch many manifests (slices, aggregates, weights); the store must keep a few rounds'."""


@dataclass(kw_only=True)
class TaskOptions:
    allowed_initiators: tuple[str, ...] = ()
    """Peer ids whose specs this node accepts; empty accepts any signed spec."""
    announce_interval_s: float = 2.0
    listen_s: float = 5.0
    """How long a new member listens for a running swarm's weights before it joins at round 0."""
    dataset_wait_s: float = 30.0
    eval_batches: int = 8
    trainer_threads: int = 1
    join: bool = True
    max_tasks: int = 2
    """Tasks run at once; each one starts a trainer process, so a flood of joinable specs must not start more."""
    specs_topic: str = SPECS_TOPIC
    env: dict[str, str] = field(default_factory=dict)

    def trainer_env(self) -> dict[str, str]:
        return {**os.environ, "TRAINER_THREADS": str(self.trainer_threads), **self.env}


@dataclass
class KnownTask:
    spec: TaskSpec
    initiator: str
    sealed: bytes
    decision: str  # "joined" | "declined" | "failed" | "cancelled"
    reason: str = ""
    runner: object = None
    scope: trio.CancelScope | None = None

    @property
    def running(self) -> bool:
        return self.decision == "joined" and self.runner is not None


class TaskService:
    def __init__(self, node, options: TaskOptions):
        self.node, self.options = node, options
        self.tasks: dict[str, KnownTask] = {}
        self._decline_log = FloodLimiter(rate_per_s=0.2, burst=20)
        self.cancels = Cancels(self)
        self._nursery: trio.Nursery | None = None

    # -- judging specs ---------------------------------------------------------------------------

    def judge(self, spec: TaskSpec, initiator: str) -> None:
        """TaskRejected with the reason if this node will not run ``spec``."""
        allowed = self.options.allowed_initiators
        if allowed and initiator not in allowed:
            raise TaskRejected(f"initiator {initiator} is not in allowed_initiators")
        me = self.node.keypair.peer_id
        if spec.trainers and me not in spec.trainers:
            raise TaskRejected(f"this node ({me}) is not among the task's {len(spec.trainers)} listed trainers")
        if spec.recipe not in KNOWN_RECIPES:
            raise TaskRejected(f"unknown recipe {spec.recipe!r}; this node runs {list(KNOWN_RECIPES)}")
        hardware = self.node.membership.hardware
        if spec.requirements.device == "cuda" and not any(d.startswith("cuda") for d in hardware.devices):
            raise TaskRejected("the task needs a CUDA device and this node has none")
        need = max(spec.requirements.min_memory_bytes, spec.memory_estimate_bytes())
        if hardware.memory_bytes and need > hardware.memory_bytes:
            raise TaskRejected(f"the task needs about {need / 2**30:.1f} GiB and this node has "
                               f"{hardware.memory_bytes / 2**30:.1f} GiB")
        if not self.options.join:
            raise TaskRejected("this node does not join tasks (join = false)")

    def _validate_spec(self, msg: GossipMessage) -> bool:
        return self.node.membership.check_gossip(msg, max_bytes=DEFAULT_TASK_SPEC_BYTES,
                                                 expect=(TaskSpec, TaskCancel)) is not None

    async def _consume_specs(self, messages) -> None:
        async for msg in messages:
            self.node.traffic.messages_in[SPECS_TOPIC] += 1
            try:
                signed = open_sealed(msg.data, max_bytes=DEFAULT_TASK_SPEC_BYTES, expect=(TaskSpec, TaskCancel))
            except RemoteProtocolError:
                continue  # already judged (and charged) by the validator
            if isinstance(signed.message, TaskCancel):
                try:
                    self.cancels.on_cancel(signed.message, signed.signer, msg.data)
                except TaskRejected:
                    pass  # logged and counted in on_cancel
                continue
            try:
                known = await self.consider(signed.message, signed.signer, msg.data)
                if known.runner is not None and msg.origin != self.node.keypair.peer_id:
                    known.runner.spec_heard_at = trio.current_time()
            except Exception:
                # The supervision point for spec intake: one bad spec must never stop the daemon.
                log.exception("task spec from %s could not be considered", msg.origin)
                self.node.membership.penalize(msg.origin, "task_intake_error")

    async def consider(self, spec: TaskSpec, initiator: str, sealed: bytes) -> KnownTask:
        tid = task_id(spec)
        known = self.tasks.get(tid)
        if known is not None:
            return known
        directory = self.node.config.data_dir / "tasks" / tid
        try:
            self.cancels.check_not_cancelled(tid, directory, initiator)
            self.judge(spec, initiator)
            running = sum(k.running for k in self.tasks.values())
            if running >= self.options.max_tasks:
                raise TaskRejected(f"this node already runs {running} task(s) (max_tasks = {self.options.max_tasks})")
        except TaskRejected as exc:
            # A flood of specs must not flood the log: after a few, declines are logged at debug level.
            level = logging.WARNING if self._decline_log.allow("declines", trio.current_time()) else logging.DEBUG
            log.log(level, "declining task %s (%s) from %s: %s", tid[:12], spec.name, initiator, exc)
            known = self._remember(tid, KnownTask(spec, initiator, sealed, "declined", str(exc)))
            self.node.traffic.drops["task_declined"] += 1
            return known
        log.info("joining task %s (%s) from %s", tid[:12], spec.name, initiator)
        known = self._remember(tid, KnownTask(spec, initiator, sealed, "joined"))
        directory.mkdir(parents=True, exist_ok=True)
        for stale in await trio.to_thread.run_sync(remove_stale_temps, directory):
            log.info("task %s: removed %s, left by a write a killed process did not finish", tid[:12], stale.name)
        write_atomic(directory / "spec.sealed", sealed)
        from node.tasks.runner import TaskRunner  # torch is imported with it
        known.runner = TaskRunner(self.node, spec, tid, directory, self.options)
        await self._nursery.start(self._supervise, tid, known, sealed)
        return known

    def _remember(self, tid: str, known: KnownTask) -> KnownTask:
        """Keep every running task; forget the oldest others past MAX_KNOWN_TASKS, so a flood cannot grow us."""
        self.tasks[tid] = known
        idle = [t for t, k in self.tasks.items() if not k.running]
        for old in idle[:max(0, len(self.tasks) - MAX_KNOWN_TASKS)]:
            del self.tasks[old]
            self.node.traffic.drops["task_forgotten"] += 1
        return known

    async def _supervise(self, tid: str, known: KnownTask, sealed: bytes,
                         task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The supervision point of one task: its failure marks it failed and never reaches the daemon.
        The runner has a cancel scope of its own, so the initiator's cancel can end it alone."""
        status = _Started(task_status)
        try:
            with trio.CancelScope() as known.scope:
                await known.runner.run(sealed, task_status=status)
        except Exception as exc:
            log.exception("task %s (%s) failed", tid[:12], known.spec.name)
            known.decision, known.reason = "failed", f"{type(exc).__name__}: {exc}"[:500]
            # The runner's own phase would still read as it was when the error escaped ("round 3: training").
            known.runner.phase, known.runner.detail = "failed", known.reason
            self.node.traffic.drops["task_failed"] += 1
        if not status.done:
            task_status.started()

    async def _resume(self) -> None:
        """Tasks this node had joined before a restart: judged again, then resumed from their checkpoints."""
        root = self.node.config.data_dir / "tasks"
        for path in sorted(root.glob("*/spec.sealed")) if root.is_dir() else ():
            try:
                signed = open_sealed(path.read_bytes(), max_bytes=DEFAULT_TASK_SPEC_BYTES, expect=TaskSpec)
            except (RemoteProtocolError, OSError) as exc:
                log.warning("not resuming %s: %s", path.parent.name, exc)
                continue
            try:
                await self.consider(signed.message, signed.signer, path.read_bytes())
            except Exception:
                log.exception("not resuming task %s", path.parent.name)

    # -- publishing ------------------------------------------------------------------------------

    async def publish(self, spec: TaskSpec) -> str:
        """Sign ``spec`` as its initiator, gossip it and consider it here too."""
        sealed = seal(spec, self.node.keypair)
        try:
            await self.node.host.publish(SPECS_TOPIC, sealed)
            self.node.traffic.messages_out[SPECS_TOPIC] += 1
        except TransportError as exc:
            log.warning("task spec not gossiped yet (%s); peers will hear it from our re-announcements", exc)
        await self.consider(spec, self.node.keypair.peer_id, sealed)
        return task_id(spec)

    # -- control API -----------------------------------------------------------------------------

    def summary(self, tid: str, known: KnownTask) -> dict:
        out = {"id": tid, "name": known.spec.name, "initiator": known.initiator, "decision": known.decision,
               "reason": known.reason}
        if known.runner is not None:
            out.update(known.runner.status())
            if known.runner.hf is not None:
                out["hf"] = known.runner.hf.info
        return out

    def status(self) -> dict | None:
        """The task this node is busiest with (the newest joined one), for /status."""
        joined = [(tid, k) for tid, k in self.tasks.items() if k.runner is not None]
        if not joined:
            declined = [{"id": tid, "reason": k.reason} for tid, k in self.tasks.items()]
            return {"declined": declined[-5:]} if declined else None
        tid, known = joined[-1]
        return self.summary(tid, known)

    async def route_list(self, request: Request) -> Response:
        return Response.json({"tasks": [self.summary(tid, k) for tid, k in self.tasks.items()]})

    async def route_show(self, request: Request) -> Response:
        tid = request.query.get("id", "")
        matches = [t for t in self.tasks if t.startswith(tid)] if len(tid) >= 4 else []
        if len(matches) != 1:
            raise HttpError(404, f"no single task matches id {tid!r}; see /tasks")
        known = self.tasks[matches[0]]
        return Response.json({**self.summary(matches[0], known), "spec": spec_to_dict(known.spec)})

    async def route_publish(self, request: Request) -> Response:
        if request.method != "POST":
            raise HttpError(405, "POST a task spec (TOML text under \"toml\", or the spec's fields)")
        body = request.json()
        now_ms = time.time_ns() // 1_000_000
        try:
            if isinstance(body, dict) and isinstance(body.get("toml"), str):
                spec = load_spec_toml(body["toml"], created_ms=now_ms)
            elif isinstance(body, dict):
                spec = spec_from_dict(body, created_ms=now_ms)
            else:
                raise ConfigError("task spec: the body must be a JSON object")
        except ConfigError as exc:
            raise HttpError(400, str(exc)) from None
        tid = await self.publish(spec)
        known = self.tasks[tid]
        return Response.json({"task_id": tid, "decision": known.decision, "reason": known.reason})

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        shardcast = getattr(self.node, "shardcast", None)
        if shardcast is None:
            raise ConfigError("the task service needs SHARDCAST: start the shardcast service before it")
        # Why here: a round's slices, aggregates and weights must outlive the store's default GC window.
        shardcast.config.keep_manifests = max(shardcast.config.keep_manifests, MIN_KEEP_MANIFESTS)
        shardcast.config.max_known_manifests = max(shardcast.config.max_known_manifests, MIN_KEEP_MANIFESTS)
        messages = self.node.host.subscribe(SPECS_TOPIC, self._validate_spec)
        self.node.routes.update({"/tasks": self.route_list, "/task": self.route_show,
                                 "/task/publish": self.route_publish, "/task/cancel": self.cancels.route_cancel})
        self.node.status_sources["task"] = self.status
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._consume_specs, messages)
            nursery.start_soon(self.cancels.serve_announcements)
            await self._resume()
            task_status.started()


class _Started:
    """A task_status that remembers whether started() was called, so a supervisor can call it once."""

    def __init__(self, inner):
        self._inner, self.done = inner, False

    def started(self, value=None) -> None:
        self.done = True
        self._inner.started(value)


def options_from_node(node) -> TaskOptions:
    allowed = tuple(getattr(node.config, "allowed_initiators", ()) or ())
    interval = min(2.0, max(0.2, node.config.heartbeat_interval_s))
    return TaskOptions(allowed_initiators=allowed, announce_interval_s=interval, listen_s=2.5 * interval,
                       max_tasks=node.config.max_tasks)


def task_service(options: TaskOptions | None = None):
    """A ServiceFactory with explicit options (tests, embedding)."""
    async def start(node, nursery: trio.Nursery) -> TaskService:
        service = TaskService(node, options or options_from_node(node))
        await nursery.start(service.run)
        node.tasks = service
        return service
    return start


async def start_task_service(node, nursery: trio.Nursery) -> TaskService:
    """The ServiceFactory for node/services.py; options come from the node's config."""
    return await task_service()(node, nursery)


__all__ = ["TaskOptions", "TaskService", "start_task_service", "task_service"]
