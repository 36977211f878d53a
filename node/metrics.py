"""Prometheus text for /metrics, rendered from the node's live counters at scrape time, with bounded label sets."""

from __future__ import annotations

import platform
from collections import defaultdict
from importlib import metadata
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

Sample = tuple[str, str, str, dict[str, str], float]
"""(name, kind "counter" | "gauge", help, labels, value)."""

MAX_LABEL_VALUES = 32
"""Distinct values one label may take in one metric; the smallest series beyond it are summed as "other"."""
SHORT_ID_CHARS = {"peer": 10, "task": 12}
"""Ids are cut to their tail (peer) or head (task): enough to tell a swarm's members apart, bounded in length."""


def short_label(key: str, value: str) -> str:
    n = SHORT_ID_CHARS.get(key)
    if n is None or len(value) <= n:
        return value
    return value[-n:] if key == "peer" else value[:n]


def bound(samples: Iterable[Sample]) -> list[Sample]:
    """Short ids, then at most MAX_LABEL_VALUES values per (metric, id label); the rest folded into "other"."""
    merged: dict[tuple, list] = {}
    for name, kind, help_text, labels, value in samples:
        labels = {k: short_label(k, str(v)) for k, v in labels.items()}
        key = (name, tuple(sorted(labels.items())))
        if key in merged:
            merged[key][4] += value
        else:
            merged[key] = [name, kind, help_text, labels, value]
    by_metric: dict[str, list[list]] = defaultdict(list)
    for row in merged.values():
        by_metric[row[0]].append(row)
    out: list[Sample] = []
    for rows in by_metric.values():
        for label in SHORT_ID_CHARS:
            values: dict[str, float] = defaultdict(float)
            for row in rows:
                if label in row[3]:
                    values[row[3][label]] += abs(row[4])
            if len(values) > MAX_LABEL_VALUES:
                keep = set(sorted(values, key=lambda v: -values[v])[:MAX_LABEL_VALUES - 1])
                folded: dict[tuple, list] = {}
                for row in rows:
                    if label in row[3] and row[3][label] not in keep:
                        row = [row[0], row[1], row[2], {**row[3], label: "other"}, row[4]]
                    k = tuple(sorted(row[3].items()))
                    if k in folded:
                        folded[k][4] += row[4]
                    else:
                        folded[k] = row
                rows = list(folded.values())
        out.extend(tuple(r) for r in rows)
    return out


class _Collector:
    def __init__(self, samples: Callable[[], Iterable[Sample]]):
        self._samples = samples

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for name, kind, help_text, labels, value in bound(self._samples()):
            family = families.get(name)
            if family is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[name] = cls(name, help_text, labels=sorted(labels))
            family.add_metric([labels[k] for k in sorted(labels)], value)
        return families.values()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def build_info() -> Sample:
    return ("shoal_build_info", "gauge", "Versions this node runs (always 1)",
            {"version": _version("shoal"), "python": platform.python_version(), "torch": _version("torch"),
             "libp2p": _version("libp2p")}, 1.0)


def render(samples: Callable[[], Iterable[Sample]]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
    PlatformCollector(registry=registry)
    registry.register(_Collector(lambda: [build_info(), *samples()]))
    return generate_latest(registry)


# -- training figures, read from the task service's public status ---------------------------------

def task_summaries(node) -> list[dict]:
    """Each known task's status, as the task service reports it for /tasks (empty without a task service)."""
    service = getattr(node, "tasks", None)
    if service is None:
        return []
    return [{**service.summary(tid, known), "inner_steps": known.spec.inner_steps}
            for tid, known in list(service.tasks.items())]


def task_samples(node) -> Iterable[Sample]:
    summaries = task_summaries(node)
    decisions: dict[str, int] = defaultdict(int)
    for t in summaries:
        decisions[t.get("decision", "unknown")] += 1
    for decision, n in decisions.items():
        yield "shoal_tasks", "gauge", "Tasks this node knows, by decision (joined, declined, failed)", \
            {"decision": decision}, n
    for t in summaries:
        if t.get("decision") != "joined" or t.get("round") is None:
            continue
        task = {"task": t["id"]}
        yield "shoal_task_round", "gauge", "Outer round the node is in", task, t["round"]
        yield "shoal_task_members", "gauge", "Members of the current round", task, len(t.get("members", []))
        if t.get("eval_loss") is not None:
            yield "shoal_task_eval_loss", "gauge", "Held-out loss after the last closed round", task, t["eval_loss"]
        rounds = t.get("agreement", [])
        trained = [a for a in rounds if a.get("train_s")]
        train_s = sum(a["train_s"] for a in trained)
        steps = t.get("inner_steps")
        if steps and train_s > 0:
            yield ("shoal_task_inner_steps_per_second", "gauge", "Inner steps per second of training, all rounds",
                   task, steps * len(trained) / train_s)
        round_s = sum(a.get("round_s", 0.0) for a in rounds)
        if round_s > 0:  # closed rounds only: the open one has training time but no round time yet
            yield ("shoal_task_training_share", "gauge", "Share of closed rounds' wall time this node trained",
                   task, sum(a.get("train_s", 0.0) for a in rounds) / round_s)
        for p in t.get("peers", []):
            if p.get("train_share") is not None:
                yield ("shoal_task_peer_training_share", "gauge", "Training share each node last announced "
                       "(trainer seconds over its rounds' wall seconds; this node's so far)",
                       {**task, "peer": p["peer_id"]}, p["train_share"])
        yield ("shoal_task_train_seconds_total", "counter", "Seconds the trainer child trained", task,
               t.get("train_seconds", 0.0))
        yield ("shoal_task_verify_seconds_total", "counter", "Seconds spent recomputing others' aggregates "
               "(their inputs' fetch included)", task, t.get("verify_seconds", 0.0))
        yield ("shoal_task_verify_compute_seconds_total", "counter", "Of which recomputing, once the inputs were "
               "fetched", task, t.get("verify_compute_seconds", 0.0))
        yield ("shoal_task_verifications_total", "counter", "Aggregates this node recomputed", task,
               t.get("verifications", 0))
        yield ("shoal_task_trainer_restarts_total", "counter", "Times the trainer child died and was restarted",
               task, t.get("trainer_restarts", 0))
        yield ("shoal_task_updates_resent_total", "counter", "Rounds answered after a restart with the update "
               "this node had already signed for them", task, t.get("updates_resent", 0))
        yield ("shoal_task_receipts", "gauge", "Receipts in this node's ledger for the task (`shoal ledger`)",
               task, t.get("receipts", 0))
        yield ("shoal_task_receipt_write_errors_total", "counter", "Rounds whose receipts could not be written",
               task, t.get("receipt_errors", 0))
        outcomes = {"agreed": 0, "dissent": 0, "caught_up": 0}
        for a in rounds:
            outcomes["caught_up" if a.get("caught_up") else "agreed" if a.get("agreed") else "dissent"] += 1
        for outcome, n in outcomes.items():
            yield ("shoal_task_rounds_total", "counter", "Closed rounds by outcome (dissent: resynced to the "
                   "majority; caught_up: taken from peers)", {**task, "outcome": outcome}, n)
        for direction, n in t.get("bytes", {}).items():
            yield ("shoal_task_bytes_total", "counter", "Task shard bytes by direction",
                   {**task, "direction": direction}, n)
        for reason, n in t.get("dropped", {}).items():
            yield ("shoal_task_rejected_total", "counter", "Task messages and updates refused, by reason",
                   {**task, "reason": reason}, n)
        yield ("shoal_task_members_not_waited_for", "gauge", "Members a round no longer waits for: each let a wait "
               "pass without an update (`shoal task show` names them)", task, len(t.get("not_waited") or {}))
        for reason, n in sorted(t.get("screened", {}).items()):
            yield ("shoal_task_screened_total", "counter", "Producers' slices this node's aggregations left out, "
                   "by reason (empty: zeros; duplicate: a near copy of another's; opposed: against the median; "
                   "outsized: many times the others' norm; one_sided: on one side of the median nearly everywhere)",
                   {**task, "reason": reason}, n)
        for reason, n in sorted(t.get("screened_applied", {}).items()):
            yield ("shoal_task_screened_applied_total", "counter", "Producers' slices the screen left out of the "
                   "aggregates this node applied, by reason (all but duplicate are charged to the producer on "
                   "every node)", {**task, "reason": reason}, n)
        checks = t.get("training_checks") or {}
        for outcome in ("passed", "untrained", "confirmed", "refuted", "unjudged"):
            if outcome in checks:
                yield ("shoal_task_training_checks_total", "counter", "Others' updates measured on their own batches, "
                       "by outcome (untrained: found here; confirmed/refuted: a peer's proof measured again; "
                       "unjudged: not checkable here)", {**task, "outcome": outcome}, checks[outcome])
        if "seconds" in checks:
            yield ("shoal_task_training_check_seconds_total", "counter", "Seconds spent measuring others' updates",
                   task, checks["seconds"])
