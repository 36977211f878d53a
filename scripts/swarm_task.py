"""Task mode of the swarm launcher: publish a task through node 0, follow it until every node has finished, report."""

from __future__ import annotations

import shutil
import time
import tomllib
from pathlib import Path

from protocol.errors import ConfigError
from protocol.spec_toml import spec_from_dict

STARTUP_MARGIN_S = 120.0
"""Added to rounds × round_deadline_s: dataset check, trainer start, the members' listen window."""
DONE = "finished"
STOPPED = ("failed", "declined")


def spec_fields(path: Path, *, rounds: int | None = None, init_manifest: str | None = None) -> dict:
    """The spec's fields from a TOML file, with overrides, checked locally; ConfigError names the mistake."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read task spec {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"task spec {path} is not valid TOML: {exc}") from None
    fields = dict(table.get("task", table))
    if rounds is not None:
        fields["rounds"] = rounds
    if init_manifest is not None:
        fields["init_manifest"] = init_manifest
    spec_from_dict(fields, created_ms=1)  # the node stamps created_ms; this only checks
    return fields


def use_local_corpus(fields: dict) -> str:
    """Point the spec at this machine's stdlib corpus if it names another Python's; returns a note, or "".

    Every node of a local swarm runs this Python, so they all build the same corpus; a spec written
    on another Python version would otherwise leave no node able to provide its dataset.
    """
    from node.train.data import build_corpus, corpus_id
    dataset = dict(fields.get("dataset") or {})
    if dataset.get("kind", "stdlib-corpus") != "stdlib-corpus" or "max_bytes" not in dataset:
        return ""
    local = corpus_id(build_corpus(int(dataset["max_bytes"])))
    if dataset.get("sha256") == local:
        return ""
    fields["dataset"] = {**dataset, "sha256": local}
    return (f"the spec's corpus {str(dataset.get('sha256'))[:16]} is another Python's stdlib; "
            f"this machine's is {local[:16]}, which every local node shares: using it")


def timeout_s(fields: dict) -> float:
    spec = spec_from_dict(fields, created_ms=1)
    return spec.rounds * spec.round_deadline_s + STARTUP_MARGIN_S


def task_of(node) -> dict:
    return (node.status or {}).get("task") or {}


class TaskRun:
    """One task on a started Swarm: publish it on node 0, then poll the nodes' watched status."""

    def __init__(self, swarm, fields: dict):
        self.swarm, self.fields = swarm, fields
        self.task_id = ""
        self.published_at = 0.0
        self.finished_at: float | None = None
        self.bytes_before: dict[str, dict] = {}
        self.final: dict[str, dict] = {}

    def publish_init(self, path: Path) -> str:
        """Publish starting weights (a safetensors file) over SHARDCAST on node 0; the spec then names them."""
        if not path.resolve().is_relative_to(self.swarm.publish_dir.resolve()):
            path = Path(shutil.copy(path, self.swarm.publish_dir / path.name))
        answer = self.swarm.nodes[0].call("/shard/publish", {"path": str(path)})
        self.fields = {**self.fields, "init_manifest": answer["manifest_id"]}
        return answer["manifest_id"]

    def publish(self) -> str:
        for node in self.swarm.nodes:
            status = node.call("/status")
            self.bytes_before[node.peer_id] = {"streams": status.get("bytes", {}), "wire": status.get("wire_bytes", {}),
                                               "gossip": status.get("gossip_bytes_sent", {})}
        answer = self.swarm.nodes[0].call("/task/publish", self.fields)
        self.task_id, self.published_at = answer["task_id"], time.monotonic()
        if answer.get("decision") == "declined":
            raise ConfigError(f"node 0 declined the task: {answer.get('reason')}")
        return self.task_id

    def mine(self, node) -> dict:
        task = task_of(node)
        return task if task.get("id") == self.task_id else {}

    def live_nodes(self) -> list:
        return [n for n in self.swarm.nodes if n.proc is not None and n.proc.poll() is None]

    def done(self) -> bool:
        if all(self.mine(n).get("phase") == DONE for n in self.live_nodes()):
            self.finished_at = self.finished_at or time.monotonic()
            return True
        return False

    def stopped(self) -> list[str]:
        """Why any live node gave up on the task (failed or declined), empty while all are working."""
        return [f"node {n.index}: {t.get('phase')} {t.get('detail')}" for n in self.live_nodes()
                if (t := self.mine(n)).get("phase") in STOPPED]

    def collect(self) -> None:
        """Fresh /status from every live node (the watchers' copy may be a poll old)."""
        for node in self.live_nodes():
            node.status = node.call("/status")
            self.final[node.peer_id] = node.status

    def report(self) -> dict:
        rounds: dict[int, dict] = {}
        for peer, status in self.final.items():
            for entry in (status.get("task") or {}).get("agreement", []):
                row = rounds.setdefault(entry["round"], {"round": entry["round"], "eval_loss": entry["eval_loss"],
                                                         "members": entry["members"], "weights_hash_by_node": {}})
                row["weights_hash_by_node"][peer] = entry["weights_hash"]
                if row["eval_loss"] is None:
                    row["eval_loss"] = entry.get("eval_loss")  # a joiner's caught-up rows are not evaluated
        for row in rounds.values():
            row["hashes_agree"] = len(set(row["weights_hash_by_node"].values())) == 1
        libp2p, wire, gossip, task_bytes, utilization, screened, checks = {}, {}, {}, {}, {}, {}, {}
        for peer, status in self.final.items():
            before = self.bytes_before.get(peer, {})
            for out, key, now in ((libp2p, "streams", status.get("bytes", {})),
                                  (wire, "wire", status.get("wire_bytes", {}))):
                out[peer] = {k: now.get(k, 0) - before.get(key, {}).get(k, 0) for k in ("sent", "received")}
            was, now = before.get("gossip", {}), status.get("gossip_bytes_sent", {})
            # Task topics are named by their id; one name for the task's own, whatever its id.
            gossip[peer] = {("task" if kind.startswith("shoal/task/") else kind): n - was.get(kind, 0)
                            for kind, n in sorted(now.items()) if n - was.get(kind, 0)}
            task = status.get("task") or {}
            task_bytes[peer] = task.get("bytes", {})
            screened[peer] = task.get("screened", {})
            checks[peer] = {k: v for k, v in (task.get("training_checks") or {}).items() if k != "findings"}
            train_s, round_s = task.get("train_seconds", 0.0), task.get("round_seconds", 0.0)
            utilization[peer] = {"train_seconds": train_s, "round_seconds": round_s,
                                 "train_fraction": round(train_s / round_s, 3) if round_s else None}
        ordered = [rounds[r] for r in sorted(rounds)]
        phases = {peer: (s.get("task") or {}).get("phase") for peer, s in self.final.items()}
        return {
            "task": {"id": self.task_id, "phases": phases, "rounds": ordered,
                     "seconds": round((self.finished_at or time.monotonic()) - self.published_at, 1)},
            # Counted from the moment the task was published. bytes_wire: every byte on each node's TCP
            # connections (gossip, handshakes, framing included: what its link carries); bytes_libp2p: the
            # payload of our streams only (shards, manifests); the task's own SHARDCAST counters beside them.
            "bytes_wire": wire, "bytes_libp2p": libp2p, "bytes_task_shardcast": task_bytes,
            "gossip_bytes_sent": gossip,
            "utilization": utilization,
            # Producers' slices each node's aggregations left out as empty or duplicate: none in an honest swarm.
            "screened": screened,
            # Others' updates each node measured on their own batches (node/tasks/checks.py), by outcome: none
            # untrained in an honest swarm.
            "training_checks": checks,
        }

    def ok(self, report: dict) -> tuple[bool, str]:
        task = report["task"]
        if not task["rounds"]:
            return False, "no round finished"
        bad = [r["round"] for r in task["rounds"] if not r["hashes_agree"]]
        if bad:
            return False, f"weights hashes disagree in rounds {bad}"
        unfinished = {p: ph for p, ph in task["phases"].items() if ph != DONE}
        if unfinished:
            return False, f"not finished: {unfinished}"
        return True, f"{len(task['rounds'])} rounds, weights hashes agree in every round"


def status_cell(node, task_id: str) -> str:
    """The live table's status column for one node."""
    task = task_of(node)
    if not task.get("id"):
        return ""
    if task_id and task["id"] != task_id:
        return "other task"
    loss = task.get("eval_loss")
    agreement = task.get("agreement") or []
    last = agreement[-1] if agreement else None
    agree = "" if last is None else (f" agree {last.get('peers_agreeing')}" if last.get("agreed") else " re-synced")
    phase = task.get("phase", "")
    phase = phase.split(": ", 1)[-1] if phase.startswith("round ") else phase
    return (f"round {task.get('round')}/{task.get('rounds')} {phase} loss "
            f"{'-' if loss is None else f'{loss:.3f}'}{agree}")
