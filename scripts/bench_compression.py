"""Held-out loss and bytes of each update compression, in-process, several seeds, side by side.

Every arm starts from the same weights and trains on the same samples (node.train.simulate.run_diloco):
data parallel, DiLoCo with fp32 updates, and DiLoCo with each update codec a task may name (node/train/codecs.py;
below 8 bits with the error feedback a node keeps), its aggregates int8 or as the arm names them ("int2/int4":
int2 updates, int4 aggregates). Bytes per node are what the simulator counts one node
sending over the run: its update and its share of the aggregate (payload bytes only; the swarm's transport
counts come from scripts/bench_diloco.py). Prints JSON; progress goes to stderr.

    python scripts/bench_compression.py --seeds 0,1,2 --arms int8,int2,topk,int4/int4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--arms", default="int8,int4,int2,topk,int4/int4,int2/int4",
                        help="comma-separated UPDATE[/AGGREGATE] codecs (node/train/codecs.py; aggregates int8 unless "
                             "named)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--pretrain-steps", type=int, default=600, help="shared warm start; 0 trains from scratch")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    from node.train.simulate import COMPRESSIONS
    from protocol.task import AGGREGATE_COMPRESSIONS
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        parser.error("--seeds takes integers separated by commas")
    arms = [x.strip() for x in args.arms.split(",") if x.strip()]
    pairs = {a: tuple(a.split("/", 1)) if "/" in a else (a, "int8") for a in arms}
    unknown = [a for a, (u, g) in pairs.items() if u not in COMPRESSIONS or u == "none" or g not in AGGREGATE_COMPRESSIONS]
    if not seeds or not arms or unknown:
        parser.error(f"--arms takes UPDATE[/AGGREGATE]: updates {[c for c in COMPRESSIONS if c != 'none']}, "
                     f"aggregates {list(AGGREGATE_COMPRESSIONS)}; not known: {unknown}")

    import torch

    from node.train.inner import AdamWConfig
    from node.train.model import ModelConfig
    from node.train.simulate import SimSetup, run_ddp, run_diloco, start_weights

    torch.set_num_threads(1)
    t0 = time.monotonic()
    losses: dict[str, list[float]] = {}
    sent: dict[str, list[int]] = {}
    for seed in seeds:
        setup = SimSetup(model=ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32), adamw=AdamWConfig(lr=3e-3),
                         batch_size=8, num_shards=64, pretrain_steps=args.pretrain_steps, seed=seed)
        start = start_weights(setup)
        common = dict(workers=args.workers, rounds=args.rounds, inner_steps=args.inner_steps, start=start)
        runs = {"ddp": lambda: run_ddp(setup, workers=args.workers, steps=args.rounds * args.inner_steps, start=start),
                "fp32": lambda: run_diloco(setup, compression="none", **common)}
        for arm in arms:
            update, aggregate = pairs[arm]
            runs[arm] = lambda u=update, g=aggregate: run_diloco(setup, compression=u, aggregate=g, **common)
        for name, run in runs.items():
            result = run()
            losses.setdefault(name, []).append(round(result.eval_loss, 4))
            sent.setdefault(name, []).append(result.bytes_per_node)
            print(f"bench_compression: seed {seed} {name}: held-out loss {losses[name][-1]}, "
                  f"{result.bytes_per_node:,} bytes per node", file=sys.stderr, flush=True)

    def gap(name: str, base: str) -> float:
        return round(100 * sum(x / b - 1 for x, b in zip(losses[name], losses[base])) / len(seeds), 2)

    def spread(values: list[float]) -> float:
        return round(max(values) - min(values), 4)

    ddp_bytes = sent["ddp"][0]
    out = {
        "arms": {name: {"loss_mean": round(sum(losses[name]) / len(seeds), 4), "loss_spread": spread(losses[name]),
                        "losses": losses[name],
                        "gap_vs_ddp_pct": gap(name, "ddp"), "gap_vs_fp32_diloco_pct": gap(name, "fp32"),
                        "bytes_per_node": sent[name][0], "fewer_bytes_than_ddp": round(ddp_bytes / sent[name][0], 1)}
                 for name in losses if name != "ddp"},
        "ddp": {"loss_mean": round(sum(losses["ddp"]) / len(seeds), 4), "losses": losses["ddp"],
                "bytes_per_node": ddp_bytes},
        "setup": {"seeds": seeds, "workers": args.workers, "rounds": args.rounds, "inner_steps": args.inner_steps,
                  "pretrain_steps": args.pretrain_steps},
        "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(out, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
