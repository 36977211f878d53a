#!/usr/bin/env python3
"""What training through the exchange costs in held-out loss, in-process, side by side on the same samples.

For each seed, from one shared warm start: data parallel, DiLoCo without overlap, and DiLoCo with each
overlap variant at each share of a round's steps taken ahead (node.train.simulate.run_diloco; "rebase"
is what the task option ``overlap`` does, the eager variants start the steps ahead from an
eager-updates estimate instead). Prints JSON: each arm's held-out loss per seed, the mean, and the
mean gap against DiLoCo without overlap.

    python scripts/bench_overlap.py --seeds 0,1,2 --variants rebase,eager --ahead 0.25,0.5,0.9
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from node.train.simulate import OVERLAPS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default="rebase,eager", help=f"of {', '.join(OVERLAPS[1:])}")
    parser.add_argument("--ahead", default="0.25,0.5,0.9", help="shares of a round's steps taken ahead")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        shares = [float(x) for x in args.ahead.split(",") if x.strip()]
    except ValueError:
        parser.error("--seeds takes integers and --ahead numbers, separated by commas")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not seeds or not variants or not set(variants) <= set(OVERLAPS[1:]) or not all(0 < a <= 1 for a in shares):
        parser.error(f"--variants must name some of {OVERLAPS[1:]} and --ahead shares within (0, 1]")

    import torch

    from node.train.inner import AdamWConfig
    from node.train.model import ModelConfig
    from node.train.simulate import SimSetup, run_ddp, run_diloco, start_weights

    torch.set_num_threads(1)
    t0 = time.monotonic()
    losses: dict[str, list[float]] = {}
    for seed in seeds:
        setup = SimSetup(model=ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32), adamw=AdamWConfig(lr=3e-3),
                         batch_size=8, num_shards=64, pretrain_steps=args.pretrain_steps, seed=seed)
        start = start_weights(setup)
        common = dict(workers=args.workers, rounds=args.rounds, inner_steps=args.inner_steps, start=start)
        arms = {"ddp": lambda: run_ddp(setup, workers=args.workers, steps=args.rounds * args.inner_steps, start=start),
                "none": lambda: run_diloco(setup, **common)}
        for v in variants:
            for a in shares:
                arms[f"{v}@{a:g}"] = lambda v=v, a=a: run_diloco(setup, overlap=v, ahead=a, **common)
        for name, run in arms.items():
            loss = round(run().eval_loss, 4)
            losses.setdefault(name, []).append(loss)
            print(f"bench_overlap: seed {seed} {name}: held-out loss {loss}", file=sys.stderr, flush=True)
    mean = {k: sum(v) / len(v) for k, v in losses.items()}
    gaps = {k: round(100 * sum(x / n - 1 for x, n in zip(v, losses["none"])) / len(v), 2)
            for k, v in losses.items() if k != "none"}
    result = {"losses": losses, "mean": {k: round(v, 4) for k, v in mean.items()},
              "gap_vs_no_overlap_pct": gaps,
              "setup": {"seeds": seeds, "workers": args.workers, "rounds": args.rounds, "inner_steps": args.inner_steps,
                        "pretrain_steps": args.pretrain_steps},
              "seconds": round(time.monotonic() - t0, 1)}
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
