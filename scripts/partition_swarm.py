"""Partitions in netlab: 4 nodes on a tiny task, one host cut off, then a 2-1-1 split; the swarm must keep one history.

    python scripts/partition_swarm.py [--cut-s 30] [--rounds 30] [--json-out FILE]      (root: network namespaces)

Each node runs in its own network-namespace host (scripts/netlab.py). A 3-round quiet task first
times this machine's rounds, and the task gets enough rounds (at least --rounds) to still be
training through both partitions. Once every node has reached round 3, host h3 is cut off for --cut-s seconds; once all four agree again, hosts h2 and h3
are cut (a 2-1-1 split, no side with min_members = 3) for --cut-s seconds. For each partition the
report says how many rounds a side below min_members closed (target 0), how many rounds after the
heal every node held one weights hash (target at most 2), and the slowest round after the heal
against the round deadline (target: none waits it out); then whether the task finished with the
hashes agreeing.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.train.data import build_corpus, corpus_id  # noqa: E402
from scripts import netlab  # noqa: E402
from scripts.local_swarm import Swarm, netlab_interrupts  # noqa: E402
from scripts.swarm_task import TaskRun  # noqa: E402

CORPUS_BYTES = 256 * 1024
ENV = {"SHOAL_HEARTBEAT_INTERVAL_S": "1", "SHOAL_SUSPECT_AFTER_S": "3", "SHOAL_DEAD_AFTER_S": "5",
       "SHOAL_HARDWARE_BENCHMARK": "false"}
MIN_MEMBERS = 3
QUIET_ROUNDS = 3
"""A short task first, whose rounds time this machine (rounds_for)."""
ROUND_DEADLINE_S = 20.0


def task_fields(rounds: int, inner_steps: int, time_budget_s: float = 0.0) -> dict:
    return {
        "name": "partition", "inner_steps": inner_steps, "time_budget_s": time_budget_s, "batch_size": 8,
        "rounds": rounds,
        "round_deadline_s": ROUND_DEADLINE_S, "min_members": MIN_MEMBERS, "max_members": 8,
        "aggregation_shards": 2, "aggregators_per_shard": 2, "seed": 5,
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32},
        "dataset": {"kind": "stdlib-corpus", "max_bytes": CORPUS_BYTES,
                    "sha256": corpus_id(build_corpus(CORPUS_BYTES)), "num_shards": 6},
        "adamw": {"lr": 3e-3, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95, "warmup_steps": 0},
    }


def log(msg: str) -> None:
    print(f"[partition {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Watch:
    def __init__(self, swarm: Swarm, run: TaskRun):
        self.swarm, self.run = swarm, run

    def wait(self, predicate, timeout_s: float, what: str) -> float:
        start = time.monotonic()
        while not predicate():
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"not within {timeout_s:.0f} s: {what}; nodes: {self.states()}")
            if self.run.task_id and self.run.stopped():
                raise RuntimeError(f"the task stopped: {self.run.stopped()}")
            self.swarm.update()
            time.sleep(0.2)
        return time.monotonic() - start

    def task(self, node) -> dict:
        return self.run.mine(node)

    def states(self) -> list:
        return [{k: self.task(n).get(k) for k in ("phase", "round", "detail")} for n in self.swarm.nodes]

    def rows(self, node) -> dict[int, dict]:
        """Rounds this node closed (not caught up to), by index."""
        return {a["round"]: a for a in self.task(node).get("agreement", []) if not a.get("caught_up")}

    def hashes(self) -> set:
        return {self.task(n).get("weights_hash") for n in self.swarm.nodes}

    def rounds(self) -> list[int]:
        return [self.task(n).get("round") or 0 for n in self.swarm.nodes]

    def agree(self) -> bool:
        return len(self.hashes()) == 1 and None not in self.hashes()


def partition(lab, watch: Watch, cut: list[str], seconds: float) -> dict:
    """Cut ``cut`` off for ``seconds``, heal, and measure what each side did and how fast they agreed."""
    nodes = watch.swarm.nodes
    by_host = {h.name: n for h, n in zip(lab.hosts, nodes)}
    groups = [[h.name for h in lab.hosts if h.name not in cut]] + [[h] for h in cut]
    before = {h: set(watch.rows(n)) for h, n in by_host.items()}
    log(f"cutting {', '.join(cut)} off for {seconds:.0f} s (sides {groups})")
    for h in cut:
        lab.cut(h)
    time.sleep(seconds)
    rows = {h: watch.rows(n) for h, n in by_host.items()}
    closed = {h: sorted(set(rows[h]) - before[h]) for h, n in by_host.items()}
    alone = sum(1 for h in cut for r in closed[h] if rows[h][r]["members"] < MIN_MEMBERS)
    for h in cut:
        lab.heal(h)
    healed_at, round_at_heal = time.monotonic(), max(watch.rounds())
    log(f"healed; rounds closed while cut: {closed}")
    watch.wait(watch.agree, 8 * ROUND_DEADLINE_S, "every node holds one weights hash after the heal")
    agreed_round = max(watch.rounds())
    log(f"one weights hash again after {time.monotonic() - healed_at:.1f} s at round {agreed_round}")
    return {"cut": cut, "seconds": seconds, "rounds_closed_while_cut": closed,
            "rounds_closed_below_min_members": alone,
            "seconds_to_one_hash": round(time.monotonic() - healed_at, 1),
            "rounds_to_one_hash": max(0, agreed_round - round_at_heal), "round_at_heal": round_at_heal}


def after_heal(watch: Watch, first_round: int, last_round: int) -> tuple[float, int]:
    """The slowest round any node closed between two rounds (seconds from its start to its verdict),
    and how many of those rounds failed (kept their weights for want of an aggregate)."""
    worst, failed = 0.0, set()
    for n in watch.swarm.nodes:
        for r, row in watch.rows(n).items():
            if first_round <= r < last_round:
                worst = max(worst, row.get("round_s", 0.0))
                if row.get("failed"):
                    failed.add(r)
    return worst, len(failed)


def rounds_for(cut_s: float, round_s: float, at_least: int) -> int:
    """Rounds enough for both partitions at this machine's pace: 3 before the first cut, the 3-node
    side's rounds while it lasts (half again, for a machine that gets faster), up to 2 to agree and
    3 more after its heal, none while the 2-1-1 split lasts, and 8 after that heal. With fewer, a
    quiet machine finishes the task before the cut ends, and the heal is never tested."""
    return max(at_least, math.ceil(1.5 * cut_s / round_s) + 16)


def run(work_dir: Path, *, rounds: int = 30, inner_steps: int = 20, cut_s: float = 30.0,
        time_budget_s: float = 0.0) -> dict:
    """``rounds``: at least this many; more where the machine's quiet rounds are short (rounds_for).
    ``time_budget_s`` (0: none) ends each member's inner steps after that long, so with many
    ``inner_steps`` a round lasts about as long on a quiet machine as on a loaded one."""
    started = time.monotonic()
    with netlab_interrupts(), netlab.open_lab(4) as lab:
        swarm = Swarm(4, work_dir, lab=lab, env=ENV)
        try:
            swarm.start(watch_interval_s=0.3)
            quiet = TaskRun(swarm, {**task_fields(QUIET_ROUNDS, inner_steps, time_budget_s), "name": "partition-quiet"})
            quiet_watch = Watch(swarm, quiet)
            quiet_watch.wait(swarm.all_see_all, 90, "every node sees the others")
            quiet.task_id = swarm.task_id = quiet.publish()
            quiet_watch.wait(quiet.done, 180, "the quiet task finishes")
            # The fastest quiet round sizes the task, so even a quiet machine is still training at the heals.
            times = [row["round_s"] for n in swarm.nodes for r, row in quiet_watch.rows(n).items() if r >= 1]
            quiet_round_s = max(min(times, default=1.0), 0.1)
            rounds = rounds_for(cut_s, quiet_round_s, rounds)
            log(f"quiet rounds of {quiet_round_s:.2f} s: the task gets {rounds} rounds")
            run_ = TaskRun(swarm, task_fields(rounds, inner_steps, time_budget_s))
            watch = Watch(swarm, run_)
            run_.task_id = swarm.task_id = run_.publish()
            watch.wait(lambda: min(watch.rounds()) >= 3, 180, "every node reaches round 3")
            one = partition(lab, watch, ["h3"], cut_s)
            watch.wait(lambda: min(watch.rounds()) >= one["round_at_heal"] + one["rounds_to_one_hash"] + 3, 240,
                       "two more rounds after the first heal")
            two = partition(lab, watch, ["h2", "h3"], cut_s)
            watch.wait(lambda: run_.done(), rounds * ROUND_DEADLINE_S, "every node finishes")
            run_.collect()
        finally:
            swarm.stop()
    report = run_.report()
    rows = report["task"]["rounds"]
    last = rows[-1]["round"] + 1 if rows else 0
    for part, nxt in ((one, two["round_at_heal"]), (two, last)):
        start = part["round_at_heal"] + part["rounds_to_one_hash"] + 1
        worst, failed = after_heal(watch, start, nxt)
        part["slowest_round_after_heal_s"], part["rounds_failed_after_heal"] = round(worst, 2), failed
    ok, why = run_.ok(report)
    _, failed = after_heal(watch, 0, last)
    return {"rounds": len(rows), "hashes_agree": ok, "verdict": why, "rounds_failed": failed,
            "quiet_round_s": round(quiet_round_s, 2),
            "round_deadline_s": ROUND_DEADLINE_S, "min_members": MIN_MEMBERS, "one_cut": one, "two_one_one": two,
            "eval_loss_first": rows[0]["eval_loss"] if rows else None,
            "eval_loss_last": rows[-1]["eval_loss"] if rows else None,
            "seconds": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--cut-s", type=float, default=30.0)
    parser.add_argument("--time-budget-s", type=float, default=0.0,
                        help="end each round's inner steps after this long (0: none), for rounds of one length")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    reason = netlab.unavailable_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="shoal-partition-"))
    try:
        report = run(work_dir, rounds=args.rounds, inner_steps=args.inner_steps, cut_s=args.cut_s,
                     time_budget_s=args.time_budget_s)
    except (TimeoutError, RuntimeError) as exc:
        print(f"error: {exc}\nthe nodes' logs are in {work_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(work_dir, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
