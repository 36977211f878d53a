"""One round's bookkeeping without training, at growing model sizes: encode, aggregate, apply, checkpoint, hashing.

    python scripts/bench_scale.py [--sizes 10000000,100000000] [--producers 4] [--slices 4] [--json-out FILE]

Runs the functions a round runs (node/tasks/compute.py) on a flat model of the given size, in
one process, and reports seconds per round, nanoseconds per parameter and bytes written per
parameter for each size. ``store_to_model_ratio`` is what a node keeps after the round: its
checkpoint, its own update's slices and the aggregates, over the model's fp32 bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from node.tasks import compute
from node.train.diloco import OuterNesterov


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def one_size(num_params: int, producers: int, slices: int, work_dir: Path) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(num_params, generator=gen)}
    state = compute.OuterState(round=0, weights=weights, outer=OuterNesterov())
    deltas = [{"w": torch.randn(num_params, generator=gen) * 1e-3} for _ in range(producers)]
    timings: dict[str, float] = {}

    t = time.perf_counter()
    encoded = [compute.split_update(d, slices) for d in deltas]  # each producer encodes its own
    timings["encode"] = (time.perf_counter() - t) / producers  # per node: it encodes one update
    bounds = compute.slice_bounds(num_params, slices)
    t = time.perf_counter()
    aggregates = []
    for s, (a, b) in enumerate(bounds):
        got = {f"p{i}": (encoded[i][s], 100) for i in range(producers)}
        data, _, _ = compute.aggregate(got, b - a)
        aggregates.append(data)
    timings["aggregate"] = time.perf_counter() - t  # all slices: the worst case of one node aggregating all
    t = time.perf_counter()
    new = compute.apply_aggregates(state, aggregates, work=producers)
    timings["apply"] = time.perf_counter() - t
    t = time.perf_counter()
    new.weights_hash(), new.state_hash()
    timings["hashing"] = time.perf_counter() - t
    ckpt = work_dir / f"ckpt{num_params}"
    t = time.perf_counter()
    compute.save_checkpoint(ckpt, new)
    timings["checkpoint"] = time.perf_counter() - t
    written = _dir_bytes(ckpt) + sum(len(x) for x in encoded[0]) + sum(len(x) for x in aggregates)
    total = sum(timings.values())
    return {"seconds_per_round": round(total, 3), "ns_per_param": round(1e9 * total / num_params, 2),
            "bytes_written_per_param": round(written / num_params, 2),
            "store_bytes": written, "seconds": {k: round(v, 3) for k, v in timings.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000000,100000000")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-scale-"))
    try:
        sizes = {int(n): one_size(int(n), args.producers, args.slices, work_dir) for n in args.sizes.split(",")}
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    largest = max(sizes)
    report = {"sizes": sizes, "producers": args.producers, "slices": args.slices,
              "store_to_model_ratio": round(sizes[largest]["store_bytes"] / (4 * largest), 2)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
