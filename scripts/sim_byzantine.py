"""Forging aggregators in the simulated swarm: how many forged results honest nodes apply, whom they ban.

A quarter (``--share``) of the simulated members forge every aggregate they make (each its own lie,
validly announced) and ignore every check; the swarm goes through joins, deaths, restarts and a
partition that heals (the task machine tests' churn). Prints JSON: whether the honest nodes agreed on
every round, forged aggregates they applied, honest nodes banned, forgers banned per honest node,
rounds that failed (a slice whose aggregators were all forgers keeps θ_r), recomputations per honest
node and round, and the CPU seconds. The simulation is the test suite's (tests/tasks/swarm_sim.py):
run from the repository root.

    python scripts/sim_byzantine.py --nodes 60 --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.task_machine import Apply  # noqa: E402
from tests.tasks.swarm_sim import Swarm, truth  # noqa: E402
from tests.tasks.test_task_machine import churn  # noqa: E402

ROUNDS = 9


def run(nodes: int, share: float, seed: int, spot_check: float) -> dict:
    names = [f"node-{i:04d}" for i in range(nodes)]
    forgers = set(random.Random(seed).sample(names, int(nodes * share)))
    started = time.process_time()
    sim = Swarm(names, rounds=ROUNDS, slices=4, k=2, min_members=nodes // 2 + 1, forge=forgers, spot_check=spot_check)
    agreed, why = True, ""
    try:
        churn(sim, names, rng=random.Random(seed), joins=max(1, nodes // 50), kills=nodes * 3 // 100,
              restarts=max(1, nodes // 100), split_share=0.3,
              progress=lambda stage: print(f"sim_byzantine: seed {seed}: {stage} (simulated {sim.now:.0f} s, "
                                           f"CPU {time.process_time() - started:.0f} s)", file=sys.stderr, flush=True))
    except AssertionError as exc:
        agreed, why = False, str(exc)[:300]
    honest = [n for n in sim.machines if n not in forgers]
    updates = {}
    for _, e in sim.events:
        m = getattr(e, "message", None)
        if m is not None and type(m).__name__ == "UpdateAnnounce":
            for s, mid in enumerate(m.manifest_ids):
                updates[(m.producer, m.round, s, mid)] = m
    applied = forged = 0
    for name, e in sim.events:
        if name in honest and isinstance(e, Apply):
            for a in e.chosen:
                applied += 1
                inputs = [updates[(p, a.round, a.slice, mid)] for p, mid in zip(a.included, a.inputs)]
                forged += a.result_hash != truth(a.round, a.slice, inputs)
    banned = [sim.machines[n].audit.banned for n in honest]
    failed = sum(1 for n, e in sim.closed if n in honest and e.failed)
    closed = sum(1 for n, _ in sim.closed if n in honest)
    return {
        "seed": seed, "nodes": nodes, "forgers": len(forgers), "agreed_every_round": agreed, "why": why,
        "aggregates_applied": applied, "forged_applied": forged,
        "honest_banned": sum(len(b - forgers) for b in banned),
        "forgers_banned_per_honest_node": [min(len(b & forgers) for b in banned), max(len(b & forgers) for b in banned)],
        "rounds_failed_share": round(failed / max(1, closed), 4),
        "recomputations_per_honest_node_round": round(sim.verifications / max(1, closed), 3),
        "cpu_s": round(time.process_time() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=60)
    parser.add_argument("--share", type=float, default=0.25, help="share of members that forge (default 0.25)")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--spot-check", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.nodes < 8 or not 0 <= args.share < 0.5:
        parser.error("--nodes must be at least 8 and --share within [0, 0.5)")
    runs = []
    for s in args.seeds.split(","):
        print(f"sim_byzantine: seed {s}: {args.nodes} members, {int(args.nodes * args.share)} forging ...",
              file=sys.stderr, flush=True)
        runs.append(run(args.nodes, args.share, int(s), args.spot_check))
        print(f"sim_byzantine: seed {s}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    print(json.dumps({"runs": runs, "all_agreed": all(r["agreed_every_round"] for r in runs),
                      "forged_applied": sum(r["forged_applied"] for r in runs),
                      "honest_banned": sum(r["honest_banned"] for r in runs)}, indent=1))
    return 0 if all(r["agreed_every_round"] and not r["forged_applied"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
