#!/usr/bin/env python3
"""Streaming fragments (task option ``fragments``) against whole-model DiLoCo, in-process, on the same samples.

For each seed, from one shared warm start: data parallel, then each arm F x H: F fragments, H inner steps a round,
as many rounds as the step budget allows (node.train.simulate.run_diloco with ``fragments``). A fragment is synced
every F rounds, so F x H/F sends the bytes of 1 x H in rounds F times as short: the same traffic in smaller, more
frequent pieces, which a node can overlap with its training. Prints JSON: each arm's held-out loss per seed, the
mean, the gap against data parallel and against the first arm, and the payload bytes per node.

    python scripts/bench_fragments.py --seeds 0,1,2 --arms 1x40,2x20,4x10,2x40 --json-out docs/bench/fragments.json
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


def _arms(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        f, _, h = item.strip().partition("x")
        out.append((int(f), int(h)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--arms", default="1x40,2x20,4x10,2x40",
                        help="FxH, comma-separated: F fragments at H inner steps a round; the first is the reference")
    parser.add_argument("--steps", type=int, default=800, help="inner steps per worker over the run, every arm")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--compression", default="int4/int4", help="updates/aggregates, as a TOML spec's default")
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        arms = _arms(args.arms)
    except ValueError:
        parser.error("--seeds takes integers, --arms FxH pairs such as 1x40,2x20")
    if not seeds or not arms or any(f < 1 or h < 1 or args.steps % h for f, h in arms):
        parser.error(f"every arm needs F >= 1 and an H that divides --steps ({args.steps})")
    compression, _, aggregate = args.compression.partition("/")

    import torch

    from node.train.inner import AdamWConfig
    from node.train.model import ModelConfig
    from node.train.simulate import SimSetup, run_ddp, run_diloco, start_weights

    torch.set_num_threads(1)
    t0 = time.monotonic()
    losses: dict[str, list[float]] = {}
    sent: dict[str, int] = {}
    for seed in seeds:
        setup = SimSetup(model=ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32), adamw=AdamWConfig(lr=3e-3),
                         batch_size=8, num_shards=64, pretrain_steps=args.pretrain_steps, seed=seed)
        start = start_weights(setup)
        runs = {"ddp": lambda: run_ddp(setup, workers=args.workers, steps=args.steps, start=start)}
        for f, h in arms:
            runs[f"{f}x{h}"] = lambda f=f, h=h: run_diloco(
                setup, workers=args.workers, rounds=args.steps // h, inner_steps=h, compression=compression,
                aggregate=aggregate or compression, start=start, fragments=f)
        for name, run in runs.items():
            result = run()
            losses.setdefault(name, []).append(round(result.eval_loss, 4))
            sent[name] = result.bytes_per_node
            print(f"bench_fragments: seed {seed} {name}: held-out loss {result.eval_loss:.4f}, "
                  f"{result.bytes_per_node:,} bytes per node", file=sys.stderr, flush=True)
    reference = f"{arms[0][0]}x{arms[0][1]}"

    def gap(name: str, against: str) -> float:
        return round(100 * sum(x / y - 1 for x, y in zip(losses[name], losses[against])) / len(seeds), 2)

    result = {
        "losses": losses,
        "mean": {k: round(sum(v) / len(v), 4) for k, v in losses.items()},
        "spread": {k: round(max(v) - min(v), 4) for k, v in losses.items()},
        "gap_vs_ddp_pct": {k: gap(k, "ddp") for k in losses if k != "ddp"},
        f"gap_vs_{reference}_pct": {k: gap(k, reference) for k in losses if k not in ("ddp", reference)},
        "bytes_per_node": sent,
        "setup": {"seeds": seeds, "workers": args.workers, "steps": args.steps, "compression": args.compression,
                  "pretrain_steps": args.pretrain_steps},
        "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
