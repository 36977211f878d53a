#!/usr/bin/env python3
"""Hostile peers against real node processes: one run per attack, the task trained to the end, JSON out.

Each run starts N node processes on loopback (scripts/local_swarm.py), of which A run
tests/integration/hostile_node.py with one attack, publishes a small tiny-lm task and waits until every
honest node has finished it. Attacks (see hostile_node.py): forge (an aggregator announcing -10x its
inputs' result), zeros (a free-rider), sign_flip (-10x its update), gaussian (its update plus noise of
10x its rms), stale (its first update replayed every round), overclaim (10x the samples it trained on
claimed, for 10x the weight in the mean), equivocate (each aggregate it makes announced twice, the second
time with another result over the same inputs), copy (each round another producer's update published as its
own, nothing trained), alie (the other producers' mean plus one standard deviation, value by value, nothing
trained), two_updates (each update signed twice, the same slices as other manifests), silent
(a member that joins and never trains: it costs time, which the run's wall seconds show). Two
baselines run first: clean (every node honest) and honest_only (the honest nodes alone, the attackers never
started). Per run, read from the honest nodes:

    loss_vs_clean_pct         final held-out loss against the clean run of the same setup (%)
    loss_vs_honest_only_pct   the same against the honest nodes training alone (the attackers never
                              started): what an attack costs beyond losing the attackers' work
    malicious_excluded_share  the attackers' update slices that did not go into the agreed weights, from
                              an honest node's receipts (None for forge: its updates are honest, its
                              aggregates are what it forges, and no agreed round applied one when the
                              honest nodes agree and their loss is the clean run's)
    honest_excluded_share     the same for the honest producers
    time_to_ban_s             from publishing the task until the last honest node banned every attacker
                              (None: some honest node never did); over seeds, the slowest
    verification_share        verification compute over training compute, honest nodes: seconds spent
                              recomputing aggregates once their inputs are fetched, and measuring others'
                              updates (the training checks), over seconds training
    verification_wall_share   the same with the recomputations' fetches counted (waiting on peers and links)
    check_seconds             of which the training checks, per honest node
    check_share               the training checks' seconds alone over seconds training
    deadlines_waited_out      per honest node, the phases (collect, gather, vote) that ran to the round's
                              deadline waiting for someone (node.log)
    seconds                   from publishing the task until every honest node finished it

Final losses of two runs of one clean seed differed by 2% here, so each attack runs with several task
seeds and the JSON keeps the mean, the spread and every run.

    python scripts/bench_byzantine.py --quick --seeds 1          # 4 nodes, 1 attacker: about 5 min here
    python scripts/bench_byzantine.py --json-out byzantine.json  # and 8 nodes with 2 attackers
    python scripts/bench_byzantine.py --setups 8x2 --seeds 1     # only those
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from node.identity import KEY_FILE  # noqa: E402
from node.tasks.ledger import read  # noqa: E402
from node.train.data import build_corpus, corpus_id  # noqa: E402
from protocol.receipts import latest  # noqa: E402
from scripts.local_swarm import Swarm  # noqa: E402
from scripts.swarm_task import TaskRun  # noqa: E402

ATTACKS = ("clean", "forge", "zeros", "sign_flip", "gaussian", "stale", "overclaim", "equivocate", "copy", "alie",
           "two_updates", "silent")
ENV = {"SHOAL_HEARTBEAT_INTERVAL_S": "1", "SHOAL_SUSPECT_AFTER_S": "3", "SHOAL_DEAD_AFTER_S": "5",
       "SHOAL_HARDWARE_BENCHMARK": "false"}
CORPUS_BYTES = 256 * 1024
SLICES = 2


def task_fields(rounds: int, inner_steps: int, nodes: int, seed: int) -> dict:
    return {
        "name": "bench-byzantine", "inner_steps": inner_steps, "batch_size": 8, "rounds": rounds,
        "round_deadline_s": 30.0, "min_members": nodes // 2 + 1, "max_members": 16, "aggregation_shards": SLICES,
        "aggregators_per_shard": 2, "seed": seed,
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32},
        "dataset": {"kind": "stdlib-corpus", "max_bytes": CORPUS_BYTES,
                    "sha256": corpus_id(build_corpus(CORPUS_BYTES)), "num_shards": 8},
        "adamw": {"lr": 3e-3, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95, "warmup_steps": 0},
    }


def _banned_everywhere(honest, attackers) -> bool:
    for node in honest:
        task = node.status.get("task") or {}
        banned = set(node.status.get("banned_peers") or ()) | set(task.get("banned") or ())
        if not all(a.peer_id in banned for a in attackers):
            return False
    return True


def run_one(work: Path, attack: str, nodes: int, attackers: int, rounds: int, inner_steps: int,
            limit_s: float, seed: int = 0) -> dict:
    alone = attack == "honest_only"
    swarm = Swarm(nodes - attackers if alone else nodes, work, env=ENV)
    for node in swarm.nodes:
        # The same keys in every run of a seed: the rendezvous hash gives each node the same data shards, so
        # runs differ by their attack, not by which node trained on what.
        node.data_dir.mkdir(parents=True, exist_ok=True)
        key = node.data_dir / KEY_FILE
        key.write_bytes(hashlib.sha256(f"bench-byzantine/{seed}/{node.index}".encode()).digest())
        key.chmod(0o600)
    bad = swarm.nodes[nodes - attackers:] if attack not in ("clean", "honest_only") else []
    for node in bad:
        node.module, node.env = "tests.integration.hostile_node", {"HOSTILE_ATTACK": attack}
    honest = [n for n in swarm.nodes if n not in bad]
    banned_at = None
    try:
        swarm.start(watch_interval_s=0.3)
        deadline = time.monotonic() + 90
        while not swarm.all_see_all():
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes did not find each other in 90 s")
            swarm.update()
            time.sleep(0.2)
        run = TaskRun(swarm, task_fields(rounds, inner_steps, nodes, seed))
        swarm.task_id = run.publish()
        published = time.monotonic()
        deadline = published + limit_s
        while not all(run.mine(n).get("phase") == "finished" for n in honest):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the honest nodes did not finish in {limit_s:.0f} s: "
                                   f"{[run.mine(n).get('phase') for n in honest]}")
            swarm.update()
            if bad and banned_at is None and _banned_everywhere(honest, bad):
                banned_at = time.monotonic() - published
            time.sleep(0.2)
        for node in honest:
            node.status = node.call("/status")
        if bad and banned_at is None and _banned_everywhere(honest, bad):
            banned_at = time.monotonic() - published
        took = time.monotonic() - published
    finally:
        swarm.stop()
    tasks = [n.status["task"] for n in honest]
    hashes = {}
    for task in tasks:
        for row in task["agreement"]:
            hashes.setdefault(row["round"], set()).add(row["weights_hash"])
    credits: dict[str, int] = {}
    receipts = latest(s.message for s in read(honest[0].data_dir / "tasks" / run.task_id, run.task_id).receipts)
    for r in receipts:
        credits[r.producer] = credits.get(r.producer, 0) + r.slices
    closed = len(hashes)

    def excluded(group) -> float | None:
        possible = closed * SLICES * len(group)
        return round(1 - sum(credits.get(n.peer_id, 0) for n in group) / possible, 4) if possible else None

    train_s = sum(t.get("train_seconds", 0.0) for t in tasks)

    def share(recomputing: str) -> float | None:
        """The training checks' seconds and those under ``recomputing``, over the seconds training."""
        return round(sum(t.get(recomputing, 0.0) + _checks(t).get("seconds", 0.0) for t in tasks) / train_s, 4) \
            if train_s else None

    return {
        "final_eval_loss": tasks[0]["eval_losses"][-1][1] if tasks[0]["eval_losses"] else None,
        "eval_losses": [x for _, x in tasks[0]["eval_losses"]],
        "rounds": closed, "hashes_agree": all(len(v) == 1 for v in hashes.values()),
        "malicious_excluded_share": excluded(bad) if bad and attack not in ("forge", "equivocate") else None,
        "honest_excluded_share": excluded(honest),
        "time_to_ban_s": None if banned_at is None else round(banned_at, 1),
        "verification_share": share("verify_compute_seconds"),
        "verification_wall_share": share("verify_seconds"),
        "verifications": [t.get("verifications", 0) for t in tasks],
        "check_seconds": [_checks(t).get("seconds", 0.0) for t in tasks],
        "check_share": round(sum(_checks(t).get("seconds", 0.0) for t in tasks) / train_s, 4) if train_s else None,
        "train_seconds": [t.get("train_seconds", 0.0) for t in tasks],
        "training_checks": [{k: _checks(t).get(k, 0) for k in ("passed", "untrained", "confirmed", "refuted",
                                                                 "unjudged")} for t in tasks],
        "screened": [t.get("screened", {}) for t in tasks],
        "forgeries_found": sum(len(t.get("forgeries", [])) for t in tasks),
        "seconds": round(took, 1),
        "deadlines_waited_out": [(n.data_dir / "node.log").read_text(errors="replace").count("ran to its deadline")
                                 for n in honest],
    }


def _checks(task: dict) -> dict:
    return task.get("training_checks") or {}


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.fmean(known), 4) if len(known) == len(values) and known else None


def _summary(runs: list[dict]) -> dict:
    """Several seeds of one attack: means (None when any seed had none), the losses' spread, every run."""
    losses = [r["final_eval_loss"] for r in runs]
    bans = [r["time_to_ban_s"] for r in runs]
    return {
        "final_eval_loss": _mean(losses),
        "final_eval_loss_spread": [min(losses), max(losses)] if None not in losses else None,
        "malicious_excluded_share": _mean([r["malicious_excluded_share"] for r in runs]),
        "honest_excluded_share": _mean([r["honest_excluded_share"] for r in runs]),
        "time_to_ban_s": max(bans) if None not in bans else None,
        "verification_share": _mean([r["verification_share"] for r in runs]),
        "verification_wall_share": _mean([r["verification_wall_share"] for r in runs]),
        "check_share": _mean([r["check_share"] for r in runs]),
        "hashes_agree": all(r["hashes_agree"] for r in runs),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 nodes with 1 attacker only (--setups 4x1)")
    parser.add_argument("--setups", default="", help="comma-separated, of 4x1 (4 nodes, 1 attacker) and 8x2; "
                        "default both, or 4x1 with --quick")
    parser.add_argument("--attacks", default=",".join(ATTACKS[1:]), help=f"comma-separated, of {', '.join(ATTACKS[1:])}")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--limit-s", type=float, default=300.0, help="per run, until the honest nodes finish")
    parser.add_argument("--seeds", type=int, default=3, help="task seeds per attack (mean and spread reported)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    attacks = ["clean", "honest_only", *(a for a in args.attacks.split(",") if a and a not in ("clean", "honest_only"))]
    unknown = [a for a in attacks if a not in ATTACKS and a != "honest_only"]
    if unknown:
        parser.error(f"unknown attack {unknown[0]!r}; known: {', '.join(ATTACKS[1:])}")
    known = {"4x1": (4, 1), "8x2": (8, 2)}
    chosen = [x for x in args.setups.split(",") if x] or (["4x1"] if args.quick else list(known))
    if any(x not in known for x in chosen):
        parser.error(f"unknown setup in {args.setups!r}; known: {', '.join(known)}")
    setups = {x: known[x] for x in chosen}
    t0 = time.monotonic()
    seeds = list(range(args.seeds))
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="shoal-byzantine-") as tmp:
        for label, (nodes, attackers) in setups.items():
            results[label] = {}
            for attack in attacks:
                runs = []
                for seed in seeds:
                    out = run_one(Path(tmp) / f"{label}-{attack}-{seed}", attack, nodes, attackers, args.rounds,
                                  args.inner_steps, args.limit_s, seed)
                    runs.append(out)
                    print(f"bench_byzantine: {label} {attack} seed {seed}: loss {out['final_eval_loss']}, excluded "
                          f"{out['malicious_excluded_share']} malicious / {out['honest_excluded_share']} honest, "
                          f"ban {out['time_to_ban_s']} s ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
                results[label][attack] = _summary(runs)
            for base in ("clean", "honest_only"):
                ref = results[label][base]["final_eval_loss"]
                for out in results[label].values():
                    loss = out["final_eval_loss"]
                    out[f"loss_vs_{base}_pct"] = None if loss is None or not ref else round(100 * (loss - ref) / ref, 2)
    first = results[next(iter(setups))]

    def most(key: str) -> float | None:
        return max((o[key] for s in results.values() for o in s.values() if o[key] is not None), default=None)

    report = {
        "command": " ".join(["python", "scripts/bench_byzantine.py", *sys.argv[1:]]),
        "attacks": {a: {k: first[a][k] for k in ("loss_vs_clean_pct", "loss_vs_honest_only_pct", "malicious_excluded_share",
                                                 "honest_excluded_share", "time_to_ban_s")} for a in attacks},
        "verification_share": most("verification_share"),
        "verification_wall_share": most("verification_wall_share"),
        "setups": results, "rounds": args.rounds, "inner_steps": args.inner_steps, "seeds": seeds,
        "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(report, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
