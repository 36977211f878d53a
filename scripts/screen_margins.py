#!/usr/bin/env python3
"""How far honest updates stay from the screen's thresholds (node/tasks/robust.py ``screen``), JSON out.

Honest producers only: the demo TinyLM trained in-process as scripts/bench_robust.py trains it (rendezvous
shards, node.train.inner, the real slices of the task's compression, int4 with error feedback unless
``--compression`` names another), from scratch and from a warm start, for each producer count
and inner-step count asked. Per slice and round it measures what the screen decides on:

    max_pairwise_cosine   the closest two producers' slices come (the screen calls 0.99 a copy)
    min_median_cosine     the lowest cosine of a producer's slice with the coordinate-wise median
                          (below 0 is "opposed")
    min_norm_ratio        the smallest norm over the median norm (at most 0.01 is "empty")
    max_norm_ratio        the largest (at least 4 is "outsized")
    max_one_sided         the highest share of a producer's values on one side of the median, on both of its
                          signs (above 0.6 is "one-sided")

and per producer and round what the training checks decide on (node/tasks/training_check.py), for
updates of 8 inner steps or more (the ones a node judges):

    min_own_gain          the lowest loss drop its whole update, as its slices decode, gives on its own
                          first batches from the round's weights (below -0.05 is "untrained")
    min_own_advantage     the lowest own_advantage of its update over the next producer's batches, with
                          the round's applied mean as the reference (below -0.02 is "a copy")

and reports the extreme of each over every slice, round and run, with the screen's own count of honest
slices it left out and the training checks' counts of honest updates they would accuse (all must be 0).

    python scripts/screen_margins.py --quick        # 4 and 8 producers, 4 rounds: about 4 min here
    python scripts/screen_margins.py --json-out docs/bench/screen-margins.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from node.tasks import compute, robust, training_check  # noqa: E402
from node.train.data import derive_seed  # noqa: E402
from node.train.diloco import OuterNesterov, flatten, pseudo_gradient  # noqa: E402
from node.train.inner import train_inner  # noqa: E402
from node.train.simulate import _data, start_weights  # noqa: E402
from protocol.rendezvous import assign_shards  # noqa: E402
from protocol.task import AggregationSpec  # noqa: E402
from node.train.compress import ErrorFeedback  # noqa: E402
from scripts.bench_robust import Bench, _setup, default_compression, encode_update, parse_compression  # noqa: E402


SCREEN = AggregationSpec(screen=True)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.double().norm()), float(b.double().norm())
    return float(a.double() @ b.double()) / (na * nb) if na and nb else 0.0


def margins_of_slice(values: dict[str, torch.Tensor]) -> dict:
    peers = sorted(values)
    norms = {p: float(values[p].double().norm()) for p in peers}
    median_norm = sorted(norms.values())[len(norms) // 2] if len(norms) % 2 else \
        sum(sorted(norms.values())[len(norms) // 2 - 1: len(norms) // 2 + 1]) / 2
    center = robust._median(torch.stack([values[p] for p in peers]))
    sided = [robust.one_sided_share(*robust.side_counts(values[p], center)) for p in peers]
    pairs = [_cos(values[a], values[b]) for i, a in enumerate(peers) for b in peers[i + 1:]]
    return {"max_pairwise_cosine": max(pairs, default=None),
            "min_median_cosine": min(_cos(values[p], center) for p in peers),
            "min_norm_ratio": min(norms.values()) / median_norm if median_norm else None,
            "max_norm_ratio": max(norms.values()) / median_norm if median_norm else None,
            "max_one_sided": max((s for s in sided if s is not None), default=None) if len(peers) >= 3 else None}


def run(bench: Bench, producers: int, seed: int, warm: bool) -> dict:
    setup = _setup(bench, seed)
    shards, _ = _data(setup)
    theta = start_weights(setup if warm else dataclasses.replace(setup, pretrain_steps=0))
    state = compute.OuterState(round=0, weights=theta, outer=OuterNesterov(lr=0.7, momentum=0.9))
    task, peers = f"screen-margins-{seed}", [f"peer-{i}" for i in range(producers)]
    opt: dict[str, dict] = {}
    codec, out = bench.codecs
    feedback = {p: ErrorFeedback(codec=codec) for p in peers} if codec.feedback else {}
    worst = {"max_pairwise_cosine": -1.0, "min_median_cosine": 1.0, "min_norm_ratio": math.inf, "max_norm_ratio": 0.0,
             "max_one_sided": 0.0,
             "min_own_gain": math.inf, "min_own_advantage": math.inf}
    left_out = accused = copied = 0
    for r in range(bench.rounds):
        assignment = assign_shards(task, r, peers, bench.num_shards)
        flats, layout = {}, None
        for p in peers:
            result = train_inner(model_config=bench.model, base_weights=state.weights,
                                 data=b"".join(shards[i] for i in assignment[p]), steps=bench.inner_steps,
                                 batch_size=bench.batch_size, seed=derive_seed(task, r, p), adamw=setup.adamw,
                                 opt_state=opt.get(p))
            opt[p] = result.opt_state
            flats[p], layout = flatten(pseudo_gradient(state.weights, result.weights))
        payloads = {p: encode_update(f, layout, bench, feedback.get(p)) for p, f in flats.items()}
        numel = sum(t.numel() for t in state.weights.values())
        bounds = compute.slice_bounds(numel, bench.num_slices)
        aggregates = []
        for s, (a, b) in enumerate(bounds):
            # What an aggregator sees: the slices decoded, not the float updates.
            got = {p: (payloads[p][s], 1) for p in payloads}
            decoded = {p: compute.decode_slice(payloads[p][s], b - a, codec) for p in payloads}
            m = margins_of_slice(decoded)
            for k in ("max_pairwise_cosine", "max_norm_ratio", "max_one_sided"):
                if m[k] is not None:
                    worst[k] = max(worst[k], m[k])
            for k in ("min_median_cosine", "min_norm_ratio"):
                if m[k] is not None:
                    worst[k] = min(worst[k], m[k])
            combined = robust.combine(got, b - a, SCREEN, codec, out)
            left_out += len(combined.screened)
            aggregates.append(combined.data)
        if training_check.judged(bench.inner_steps):
            # The round's mean as applied: the reference a copy is told by.
            reference = torch.cat([compute.decode_slice(d, b - a, out) for d, (a, b) in zip(aggregates, bounds)])
            drawn = {p: training_check.own_batches(b"".join(shards[i] for i in assignment[p]), bench.model.seq_len,
                                                   bench.batch_size, derive_seed(task, r, p), bench.inner_steps,
                                                   count=training_check.COPY_BATCHES)
                     for p in peers}
            for i, p in enumerate(peers):
                delta = torch.cat([compute.decode_slice(payloads[p][s], b - a, codec)
                                   for s, (a, b) in enumerate(bounds)])
                gain = training_check.own_gain(bench.model, state.weights, delta, drawn[p][:training_check.CHECK_BATCHES])
                worst["min_own_gain"] = min(worst["min_own_gain"], gain)
                accused += training_check.untrained(gain)
                # Against the next producer's batches, as if the screen had found the two near copies.
                other = peers[(i + 1) % len(peers)]
                advantage = training_check.own_advantage(bench.model, state.weights, delta, reference, drawn[p],
                                                         drawn[other])
                worst["min_own_advantage"] = min(worst["min_own_advantage"], advantage)
                copied += training_check.copied(advantage)
        state = compute.apply_aggregates(state, aggregates, state.work + producers, out)
    return {**{k: round(v, 4) if math.isfinite(v) else None for k, v in worst.items()},
            "honest_slices_screened_out": left_out,
            "honest_updates_untrained": accused, "honest_updates_copied": copied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 and 8 producers, 4 rounds, 12 inner steps")
    parser.add_argument("--producers", default="4,8,16")
    parser.add_argument("--inner-steps", default="2,8,12")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=Bench.batch_size)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--compression", default=default_compression(),
                        help="UPDATE[/AGGREGATE] as a task spec names them (default: a TOML spec's, %(default)s)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    try:
        compression, aggregate = parse_compression(args.compression)
    except ValueError as exc:
        parser.error(str(exc))
    producers = [4, 8] if args.quick else [int(x) for x in args.producers.split(",") if x]
    steps = [12] if args.quick else [int(x) for x in args.inner_steps.split(",") if x]
    rounds = 4 if args.quick else args.rounds
    seeds = 1 if args.quick else args.seeds
    if not producers or min(producers) < 2 or not steps or min(steps) < 1 or rounds < 1 or seeds < 1 \
            or args.batch_size < 1:
        parser.error("producers must be 2 or more, inner steps, rounds, seeds and the batch size 1 or more")
    t0 = time.monotonic()
    runs = []
    for n in producers:
        for h in steps:
            for warm in (False, True):
                for seed in range(seeds):
                    bench = Bench(rounds=rounds, inner_steps=h, compression=compression,
                                  aggregate_compression=aggregate, batch_size=args.batch_size)
                    out = {"producers": n, "inner_steps": h, "start": "warm" if warm else "scratch", "seed": seed,
                           **run(bench, n, seed, warm)}
                    runs.append(out)
                    print(f"screen_margins: {json.dumps(out)} ({time.monotonic() - t0:.0f} s)", file=sys.stderr,
                          flush=True)
    report = {
        "command": " ".join(["python", "scripts/screen_margins.py", *sys.argv[1:]]),
        "compression": f"{compression}/{aggregate}", "batch_size": args.batch_size,
        "thresholds": {"duplicate_cosine": robust.DUPLICATE_COSINE, "opposed_cosine": robust.OPPOSED_COSINE,
                       "empty_share": robust.EMPTY_SHARE, "outsized_share": robust.OUTSIZED_SHARE,
                       "one_sided_share": 0.5 + robust.ONE_SIDED_SHARE,
                       "untrained_gain": training_check.UNTRAINED_GAIN,
                       "check_min_steps": training_check.CHECK_MIN_STEPS, "copy_margin": training_check.COPY_MARGIN},
        "worst": {"max_pairwise_cosine": max(r["max_pairwise_cosine"] for r in runs),
                  "min_median_cosine": min(r["min_median_cosine"] for r in runs),
                  "min_norm_ratio": min(r["min_norm_ratio"] for r in runs),
                  "max_norm_ratio": max(r["max_norm_ratio"] for r in runs),
                  "max_one_sided": max(r["max_one_sided"] for r in runs),
                  "min_own_gain": min((r["min_own_gain"] for r in runs if r["min_own_gain"] is not None), default=None),
                  "honest_slices_screened_out": sum(r["honest_slices_screened_out"] for r in runs),
                  "min_own_advantage": min((r["min_own_advantage"] for r in runs if r["min_own_advantage"] is not None),
                                           default=None),
                  "honest_updates_untrained": sum(r["honest_updates_untrained"] for r in runs),
                  "honest_updates_copied": sum(r["honest_updates_copied"] for r in runs)},
        "runs": runs, "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(report, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
