#!/usr/bin/env python3
"""Robust aggregation rules against poisoned updates: the demo TinyLM trained in-process, one run per rule and attack.

Each run is DiLoCo rounds as a swarm runs them, in one process with no nodes: honest producers train
with node.train.inner.train_inner from a shared warm start on their rendezvous-assigned shards, every
update goes through the real slices of the task's compression (compute.split_update; int4 with error
feedback by default, ``--compression`` as a spec names it), each slice through the real aggregation
(robust.aggregate_slice, the function an aggregator runs), and the aggregates, encoded by the task's
aggregate compression, through the real outer step (compute.apply_aggregates). Attackers craft their updates each round:

    sign_flip_x10  its own trained update times -10
    gaussian       its own update plus Gaussian noise of 10x its rms
    zeros          nothing, with full samples claimed
    stale          its round-0 update replayed every round, training nothing after
    alie           "A little is enough": mean + 1.0 x std of the honest updates, per coordinate
    ipm            inner-product manipulation: -0.5 x the honest mean
    overclaim      a tenth of the inner steps, full samples claimed
    copy           an honest producer's update with noise at 1% of its norm (a free-rider that trains nothing)

``centered_clip+screen+checks`` adds the nodes' training checks (node/tasks/checks.py): after each round
every producer's whole update, as its slices decode, is measured on its own batches from the round's weights
(and one the screen left out as a near copy, against the other near copies' batches), and a producer found
in two rounds less than training_check.STRIKE_ROUNDS apart is left out from then on (its slices count as
excluded).

Reported per setup (producers x attackers), rule and attack: the final held-out loss, its change
against the same rule's clean run (%), and each rule's clean loss against the plain mean's (%).
The default is chosen from these numbers (``choose``) and printed with them, as JSON on stdout.

    python scripts/bench_robust.py --quick          # 4 producers, 1 attacker, 1 seed: ~3 min on 2 busy cores
    python scripts/bench_robust.py --json-out robust.json   # both setups, 2 seeds: ~26 min (docs/bench/robust.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from node.tasks import compute, robust, training_check  # noqa: E402
from node.train.codecs import CODECS, Codec  # noqa: E402
from node.train.compress import ErrorFeedback  # noqa: E402
from node.train.data import derive_seed  # noqa: E402
from node.train.diloco import OuterNesterov, flatten, pseudo_gradient, unflatten  # noqa: E402
from node.train.inner import AdamWConfig, evaluate, train_inner  # noqa: E402
from node.train.model import ModelConfig  # noqa: E402
from protocol.errors import IntegrityError  # noqa: E402
from node.train.simulate import SimSetup, _data, start_weights  # noqa: E402
from protocol.rendezvous import assign_shards  # noqa: E402
from protocol.spec_toml import TOML_AGGREGATE_COMPRESSION, TOML_COMPRESSION  # noqa: E402
from protocol.task import AGGREGATE_COMPRESSIONS, KNOWN_COMPRESSIONS, AggregationSpec  # noqa: E402

ATTACKS = ("clean", "sign_flip_x10", "gaussian", "zeros", "stale", "alie", "ipm", "overclaim", "copy")
NORM_BOUND = 2.0
RULES = {
    "mean": AggregationSpec(),
    "mean+bound": AggregationSpec(rule="mean", norm_bound=NORM_BOUND),
    "trimmed_mean": AggregationSpec(rule="trimmed_mean", norm_bound=NORM_BOUND),
    "median": AggregationSpec(rule="median", norm_bound=NORM_BOUND),
    "centered_clip": AggregationSpec(rule="centered_clip", norm_bound=NORM_BOUND),
    "centered_clip+screen": AggregationSpec(rule="centered_clip", norm_bound=NORM_BOUND, screen=True),
    "centered_clip+screen+checks": AggregationSpec(rule="centered_clip", norm_bound=NORM_BOUND, screen=True),
}
CHECKED = {"centered_clip+screen+checks"}
"""Rules run with the nodes' training checks (node/tasks/checks.py): after each round every producer's whole
update is measured on its own batches from the round's weights, and one found in two nearby rounds is left out
from then on."""
DEMO_MODEL = ModelConfig(n_layer=2, n_head=2, d_model=64, seq_len=64)
"""examples/tiny-task.toml's model."""
HONEST_COST_PCT = 1.0
"""A default may cost honest training at most this much held-out loss against the plain mean."""
ALIE_Z = 1.0
IPM_EPSILON = 0.5
NOISE_RMS = 10.0
COPY_NOISE = 0.01


@dataclass(frozen=True, kw_only=True)
class Bench:
    model: ModelConfig = DEMO_MODEL
    rounds: int = 8
    inner_steps: int = 12
    batch_size: int = 8
    pretrain_steps: int = 200
    num_slices: int = 2
    num_shards: int = 24
    eval_batches: int = 16
    corpus_bytes: int = 1 << 20
    compression: str = "int4"
    aggregate_compression: str = "int4"

    @property
    def codecs(self) -> tuple[Codec, Codec]:
        return CODECS[self.compression], CODECS[self.aggregate_compression]


def default_compression() -> str:
    """A TOML spec's compression when it names none, as UPDATE/AGGREGATE."""
    return f"{TOML_COMPRESSION}/{TOML_AGGREGATE_COMPRESSION}"


def parse_compression(text: str) -> tuple[str, str]:
    """"int4/int4" or "int8": the update compression and the aggregates' (int8 when not given)."""
    update, _, aggregate = text.partition("/")
    if update not in KNOWN_COMPRESSIONS or (aggregate or "int8") not in AGGREGATE_COMPRESSIONS:
        raise ValueError(f"compression {text!r}: UPDATE of {', '.join(KNOWN_COMPRESSIONS)}, "
                         f"optionally /AGGREGATE of {', '.join(AGGREGATE_COMPRESSIONS)}")
    return update, aggregate or "int8"


def encode_update(flat: torch.Tensor, layout, bench: Bench, feedback: ErrorFeedback | None) -> list[bytearray]:
    """A producer's slices as its node sends them: below 8 bits (and with top-k) through its error feedback."""
    codec, _ = bench.codecs
    if feedback is None:
        return compute.split_update(unflatten(flat, layout), bench.num_slices, codec)
    bounds = compute.slice_bounds(flat.numel(), bench.num_slices)
    return [feedback.encode(f"slice{s}", flat[a:b].contiguous()) for s, (a, b) in enumerate(bounds)]


def _setup(bench: Bench, seed: int) -> SimSetup:
    return SimSetup(model=bench.model, adamw=AdamWConfig(lr=3e-3), batch_size=bench.batch_size,
                    corpus_bytes=bench.corpus_bytes, num_shards=bench.num_shards, eval_batches=bench.eval_batches,
                    eval_batch_size=16, seed=seed, pretrain_steps=bench.pretrain_steps)


def _mean_std(flats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    stack = torch.stack(flats)
    return stack.mean(dim=0), stack.std(dim=0, unbiased=False)


@dataclass
class Excluded:
    """Slices left out of aggregation (did not decode, or screened), the attackers' and the honest producers'."""

    malicious: int = 0
    malicious_total: int = 0
    honest: int = 0
    honest_total: int = 0


def run_one(bench: Bench, rule: AggregationSpec, attack: str, *, producers: int, attackers: int, seed: int,
            start=None, excluded: Excluded | None = None, checks: bool = False) -> float | None:
    """The final held-out loss of one run; None when the weights diverged (non-finite). ``excluded`` counts
    the slices left out (those of a producer the training checks banned included)."""
    excluded = excluded if excluded is not None else Excluded()
    setup = _setup(bench, seed)
    shards, heldout = _data(setup)
    theta0 = start if start is not None else start_weights(setup)
    state = compute.OuterState(round=0, weights=theta0, outer=OuterNesterov(lr=0.7, momentum=0.9))
    task = f"bench-robust-{seed}"
    peers = [f"peer-{i}" for i in range(producers)]
    bad = set(peers[:attackers]) if attack != "clean" else set()
    cap = bench.inner_steps * bench.batch_size
    opt_states: dict[str, dict] = {}
    codec, out = bench.codecs
    feedback = {p: ErrorFeedback(codec=codec) for p in peers} if codec.feedback else {}
    first: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(derive_seed(task, "noise"))
    strikes: dict[str, list[int]] = {}
    banned: set[str] = set()

    def train(peer: str, r: int, steps: int, assignment) -> tuple[torch.Tensor, list, int]:
        result = train_inner(model_config=bench.model, base_weights=state.weights,
                             data=b"".join(shards[i] for i in assignment[peer]), steps=steps,
                             batch_size=bench.batch_size, seed=derive_seed(task, r, peer), adamw=setup.adamw,
                             opt_state=opt_states.get(peer))
        opt_states[peer] = result.opt_state
        flat, layout = flatten(pseudo_gradient(state.weights, result.weights))
        return flat, layout, result.samples

    for r in range(bench.rounds):
        assignment = assign_shards(task, r, peers, bench.num_shards)
        updates: dict[str, tuple[torch.Tensor, int]] = {}
        layout = None
        for peer in peers:
            if peer not in bad:
                flat, layout, samples = train(peer, r, bench.inner_steps, assignment)
                updates[peer] = (flat, samples)
        honest = [updates[p][0] for p in sorted(updates)]
        mean, std = _mean_std(honest)
        for peer in sorted(bad):
            if attack in ("sign_flip_x10", "gaussian"):
                own, layout, _ = train(peer, r, bench.inner_steps, assignment)
                if attack == "sign_flip_x10":
                    crafted = own * -10.0
                else:
                    rms = own.square().mean().sqrt()
                    crafted = own + torch.randn(own.shape, generator=gen) * (NOISE_RMS * rms)
            elif attack == "zeros":
                crafted = torch.zeros_like(mean)
            elif attack == "stale":
                if peer not in first:
                    first[peer], layout, _ = train(peer, r, bench.inner_steps, assignment)
                crafted = first[peer]
            elif attack == "alie":
                crafted = mean + ALIE_Z * std
            elif attack == "ipm":
                crafted = mean * -IPM_EPSILON
            elif attack == "overclaim":
                crafted, layout, _ = train(peer, r, max(1, bench.inner_steps // 10), assignment)
            elif attack == "copy":
                victim = honest[0]
                crafted = victim + torch.randn(victim.shape, generator=gen) * (COPY_NOISE * victim.norm()
                                                                                / victim.numel() ** 0.5)
            else:
                raise ValueError(f"unknown attack {attack!r}")
            updates[peer] = (crafted, cap)
        try:
            payloads = {p: encode_update(flat, layout, bench, feedback.get(p))
                        for p, (flat, _) in sorted(updates.items())}
            numel = sum(t.numel() for t in state.weights.values())
            bounds = compute.slice_bounds(numel, bench.num_slices)
            aggregates, unchecked, copies = [], set(banned), set()
            for s, (a, b) in enumerate(bounds):
                got = robust.combine({p: (payloads[p][s], updates[p][1]) for p in payloads if p not in banned}, b - a,
                                     rule, codec, out)
                if got.data is None:
                    raise IntegrityError("every slice was screened out")
                aggregates.append(got.data)
                left_out = {*got.bad, *got.screened, *banned}
                # A node checks the producers its applied aggregates included, and near copies of each other.
                unchecked |= {*got.bad, *(p for p, why in got.screened.items() if why != "duplicate")}
                copies |= {p for p, why in got.screened.items() if why == "duplicate"}
                excluded.malicious += len(bad & left_out)
                excluded.malicious_total += len(bad)
                excluded.honest += len(left_out - bad)
                excluded.honest_total += len(payloads) - len(bad)
        except ValueError:  # an update or the aggregate went non-finite: the run diverged
            return None
        if checks and training_check.judged(bench.inner_steps):
            reference = torch.cat([compute.decode_slice(d, b - a, out) for d, (a, b) in zip(aggregates, bounds)])
            drawn = {p: training_check.own_batches(b"".join(shards[i] for i in assignment[p]), bench.model.seq_len,
                                                   bench.batch_size, derive_seed(task, r, p), bench.inner_steps,
                                                   count=training_check.COPY_BATCHES)
                     for p in payloads}
            for p in sorted(set(payloads) - unchecked):
                delta = torch.cat([compute.decode_slice(payloads[p][s], b - a, codec) for s, (a, b) in enumerate(bounds)])
                others = sorted(copies - {p}) if p in copies else []
                if training_check.untrained(training_check.own_gain(
                        bench.model, state.weights, delta, drawn[p][:training_check.CHECK_BATCHES])) or \
                        any(training_check.copied(training_check.own_advantage(
                            bench.model, state.weights, delta, reference, drawn[p], drawn[o])) for o in others):
                    strikes.setdefault(p, []).append(r)
                    if training_check.banned_at(strikes[p]):
                        banned.add(p)
        state = compute.apply_aggregates(state, aggregates, state.work + len(updates), out)
    loss = evaluate(bench.model, state.weights, heldout, bench.eval_batches, seed=seed + 1, batch_size=16)
    return loss if math.isfinite(loss) else None


def _share(part: int, total: int) -> float | None:
    return round(part / total, 4) if total else None


def _pct(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return round(100.0 * (value - reference) / reference, 2)


def choose(results: dict) -> tuple[str, str]:
    """The rule to default to, and why: among the rules whose clean runs cost honest training at most
    HONEST_COST_PCT against the plain mean, the one whose worst attack (over setups) hurts least."""
    worst: dict[str, float] = {}
    for name in [n for n in RULES if n not in CHECKED]:  # the checks are the nodes', not an aggregation option
        costs = [results[s][name]["clean_vs_mean_pct"] for s in results]
        if any(c is None or c > HONEST_COST_PCT for c in costs):
            continue
        changes = [a["vs_clean_pct"] for s in results for k, a in results[s][name]["attacks"].items() if k != "clean"]
        worst[name] = math.inf if any(c is None for c in changes) else max(changes)
    if not worst:
        return "mean", "no robust rule kept honest training within the allowed cost"
    best = min(worst, key=lambda n: (worst[n], n))
    return best, (f"worst attack +{worst[best]:.2f}% over the clean run, clean cost within {HONEST_COST_PCT}% of the "
                  f"mean; others' worst: " + ", ".join(f"{n} {w:+.2f}%" for n, w in sorted(worst.items()) if n != best))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 producers with 1 attacker, one seed, fewer rounds")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--inner-steps", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--rules", help=f"comma-separated, of {', '.join(RULES)} (the plain mean always runs, as the "
                                        "reference)")
    parser.add_argument("--compression", default=default_compression(),
                        help="UPDATE[/AGGREGATE] as a task spec names them (default: a TOML spec's, %(default)s)")
    parser.add_argument("--attacks", help=f"comma-separated, of {', '.join(ATTACKS[1:])} (the clean run always runs, "
                                          "as the reference)")
    args = parser.parse_args()
    attacks_run = ["clean", *(a for a in (args.attacks or ",".join(ATTACKS)).split(",") if a and a != "clean")]
    unknown = [a for a in attacks_run if a not in ATTACKS]
    if unknown:
        parser.error(f"unknown attack {unknown[0]!r}; known: {', '.join(ATTACKS[1:])}")
    try:
        compression, aggregate = parse_compression(args.compression)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rules:
        chosen = ["mean", *(r for r in args.rules.split(",") if r != "mean")]
        unknown = [r for r in chosen if r not in RULES]
        if unknown:
            parser.error(f"unknown rule {unknown[0]!r}; known: {', '.join(RULES)}")
        for name in [n for n in RULES if n not in chosen]:
            del RULES[name]
    torch.set_num_threads(args.threads)
    bench = Bench(rounds=5, inner_steps=8, pretrain_steps=100) if args.quick else Bench()
    bench = dataclasses.replace(bench, compression=compression, aggregate_compression=aggregate,
                                **{k: v for k, v in (("rounds", args.rounds), ("inner_steps", args.inner_steps))
                                   if v is not None})
    setups = {"4x1": (4, 1)} if args.quick else {"4x1": (4, 1), "8x2": (8, 2)}
    seeds = [0] if args.quick else list(range(args.seeds))
    t0 = time.monotonic()
    starts = {seed: start_weights(_setup(bench, seed)) for seed in seeds}
    results: dict = {}
    for label, (producers, attackers) in setups.items():
        results[label] = {}
        for name, rule in RULES.items():
            attacks = {}
            for attack in attacks_run:
                excluded = Excluded()
                losses = [run_one(bench, rule, attack, producers=producers, attackers=attackers, seed=seed,
                                  start=starts[seed], excluded=excluded, checks=name in CHECKED) for seed in seeds]
                loss = None if any(x is None for x in losses) else statistics.fmean(losses)
                attacks[attack] = {"loss": None if loss is None else round(loss, 4), "losses": losses,
                                   "malicious_excluded_share": _share(excluded.malicious, excluded.malicious_total),
                                   "honest_excluded_share": _share(excluded.honest, excluded.honest_total)}
                print(f"bench_robust: {label} {name} {attack}: {losses} ({time.monotonic() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
            clean = attacks["clean"]["loss"]
            for a in attacks.values():
                a["vs_clean_pct"] = _pct(a["loss"], clean)
            results[label][name] = {"attacks": attacks}
        mean_clean = results[label]["mean"]["attacks"]["clean"]["loss"]
        for entry in results[label].values():
            entry["clean_vs_mean_pct"] = _pct(entry["attacks"]["clean"]["loss"], mean_clean)
    default, why = choose(results)
    report = {
        "command": " ".join(["python", "scripts/bench_robust.py", *sys.argv[1:]]),
        "bench": {**dataclasses.asdict(bench), "model": dataclasses.asdict(bench.model)}, "seeds": seeds,
        "rules": {n: {**dataclasses.asdict(r), "training_checks": n in CHECKED} for n, r in RULES.items()},
        "results": results, "default": default, "why": why, "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(report, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
