"""`shoal task cancel`: the initiator's signed TaskCancel ends a task on every node; anyone else's is refused.

A cancel travels on the specs topic, is kept in the task's directory (cancel.sealed) so a restarted
node does not resume the task, and is re-gossiped with the specs so a node that was away hears it.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import trio

from node.control import HttpError, Request, Response
from protocol.envelope import open_sealed, seal
from protocol.errors import RemoteProtocolError, TaskRejected, TransportError
from protocol.task import DEFAULT_TASK_SPEC_BYTES, SPECS_TOPIC, TaskCancel

log = logging.getLogger("shoal.tasks")

FILE = "cancel.sealed"
MAX_CANCELS = 256


class Cancels:
    def __init__(self, service):
        self.service = service
        self.sealed: dict[str, bytes] = {}
        """Honoured cancels by task id, re-gossiped every announce interval."""
        self.refused: Counter[str] = Counter()
        """Cancels refused, by the signer that is not the task's initiator."""

    def _dir(self, tid: str) -> Path:
        return self.service.node.config.data_dir / "tasks" / tid

    def check_not_cancelled(self, tid: str, directory: Path, initiator: str) -> None:
        """TaskRejected if the initiator cancelled this task before (heard now or kept on disk)."""
        sealed = self.sealed.get(tid)
        if sealed is None and (directory / FILE).is_file():
            try:
                signed = open_sealed((directory / FILE).read_bytes(), max_bytes=DEFAULT_TASK_SPEC_BYTES,
                                     expect=TaskCancel)
            except (RemoteProtocolError, OSError):
                return
            if signed.signer == initiator and signed.message.task_id == tid:
                self.sealed[tid] = (directory / FILE).read_bytes()
                sealed = self.sealed[tid]
        if sealed is not None:
            raise TaskRejected("cancelled by its initiator")

    def on_cancel(self, cancel: TaskCancel, signer: str, sealed: bytes) -> None:
        """Honour a cancel signed by the task's initiator; refuse (log, count, raise) anyone else's."""
        known = self.service.tasks.get(cancel.task_id)
        if known is None or cancel.task_id in self.sealed:
            return
        if signer != known.initiator:
            self.refused[signer] += 1
            log.warning("refused a cancel of task %s from %s: only its initiator %s may cancel it",
                        cancel.task_id[:12], signer, known.initiator)
            raise TaskRejected(f"only the initiator {known.initiator} may cancel task {cancel.task_id[:12]}; "
                               f"the cancel is signed by {signer}")
        if len(self.sealed) < MAX_CANCELS:
            self.sealed[cancel.task_id] = sealed
        directory = self._dir(cancel.task_id)
        if directory.is_dir():
            (directory / FILE).write_bytes(sealed)
        reason = cancel.reason or "cancelled by its initiator"
        log.info("task %s cancelled by its initiator: %s", cancel.task_id[:12], reason)
        known.decision, known.reason = "cancelled", reason
        if known.runner is not None:
            known.runner.phase, known.runner.detail = "cancelled", reason
        if known.scope is not None:
            known.scope.cancel()

    async def route_cancel(self, request: Request) -> Response:
        if request.method != "POST":
            raise HttpError(405, "POST {\"id\": task id or prefix, \"reason\": \"...\"}")
        body = request.json()
        prefix, reason = str(body.get("id", "")), str(body.get("reason", ""))[:256]
        matches = [t for t in self.service.tasks if t.startswith(prefix)] if len(prefix) >= 4 else []
        if len(matches) != 1:
            raise HttpError(404, f"no single task matches id {prefix!r}; see /tasks")
        node = self.service.node
        cancel = TaskCancel(task_id=matches[0], reason=reason)
        sealed = seal(cancel, node.keypair)
        try:
            self.on_cancel(cancel, node.keypair.peer_id, sealed)
        except TaskRejected as exc:
            raise HttpError(403, str(exc)) from None
        await self._gossip(sealed)
        return Response.json({"task_id": matches[0], "decision": "cancelled"})

    async def _gossip(self, sealed: bytes) -> None:
        try:
            await self.service.node.host.publish(SPECS_TOPIC, sealed)
            self.service.node.traffic.messages_out[SPECS_TOPIC] += 1
        except TransportError as exc:
            log.debug("cancel not gossiped: %s", exc)

    async def serve_announcements(self) -> None:
        while True:
            await trio.sleep(self.service.options.announce_interval_s)
            for sealed in list(self.sealed.values()):
                await self._gossip(sealed)
