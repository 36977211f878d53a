"""In-process reference runs (single worker, data parallel, DiLoCo) on the same model, data and samples.

run_diloco uses exactly the functions a swarm round uses: assign_shards, derive_seed,
train_inner, pseudo_gradient, int8 encode/decode, weighted_mean_by_peer and OuterNesterov.
Data parallel is simulated as one worker with a K-times larger batch: the mean of K equal-size
mean gradients is the gradient of the mean loss over all K·B samples.

    python -m node.train.simulate   # K=4, 20 rounds of H=40, from a 600-step warm start

On 2 CPU cores that takes about 2.5 minutes; DiLoCo (int8) ends about 3% above data parallel's
held-out loss while sending about 118x fewer bytes per node.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from dataclasses import dataclass

import torch

from node.train.codecs import CODECS
from node.train.compress import ErrorFeedback
from node.train.data import DEFAULT_CORPUS_BYTES, build_corpus, derive_seed, split_corpus
from node.train.diloco import (Named, OuterNesterov, flatten, fragments as fragment_split, local_weights, named_tensors,
                               pseudo_gradient, streaming_update, unflatten, weighted_mean_by_peer)
from node.train.inner import AdamWConfig, InnerLoop, evaluate, train_inner
from node.train.model import ModelConfig, init_model, num_params
from protocol.rendezvous import assign_shards
from protocol.task import AGGREGATE_COMPRESSIONS, outer_defaults

TASK_ID = "simulate"
COMPRESSIONS = (*CODECS, "none")


@dataclass(frozen=True, kw_only=True)
class SimSetup:
    model: ModelConfig
    adamw: AdamWConfig = AdamWConfig()
    batch_size: int = 8  # per worker and step
    corpus_bytes: int = DEFAULT_CORPUS_BYTES
    num_shards: int = 64  # many small shards, so each worker's round mixes several parts of the stdlib
    eval_batches: int = 32
    eval_batch_size: int = 16
    seed: int = 0
    pretrain_steps: int = 0  # shared single-worker steps before the compared runs (the DiLoCo paper's warm start)


@dataclass(frozen=True, kw_only=True)
class SimResult:
    name: str
    eval_loss: float  # nats per byte on the held-out split
    samples: int  # sequences trained on, all workers together
    bytes_per_node: int  # what one node sends in the whole run
    seconds: float


@functools.lru_cache(maxsize=2)
def _split(corpus_bytes: int, num_shards: int) -> tuple[list[bytes], bytes]:
    return split_corpus(build_corpus(corpus_bytes), num_shards)


def _data(setup: SimSetup) -> tuple[list[bytes], bytes]:
    return _split(setup.corpus_bytes, setup.num_shards)


def start_weights(setup: SimSetup) -> Named:
    """The common starting point: the seeded init, then pretrain_steps of single-worker training."""
    weights = named_tensors(init_model(setup.model, setup.seed))
    if setup.pretrain_steps:
        shards, _ = _data(setup)
        weights = train_inner(
            model_config=setup.model, base_weights=weights, data=b"".join(shards), steps=setup.pretrain_steps,
            batch_size=setup.batch_size, seed=derive_seed(TASK_ID, "pretrain"), adamw=setup.adamw,
        ).weights
    return weights


def _eval(setup: SimSetup, weights, heldout: bytes) -> float:
    return evaluate(setup.model, weights, heldout, setup.eval_batches, seed=setup.seed + 1, batch_size=setup.eval_batch_size)


def heldout_loss(setup: SimSetup, weights: Named) -> float:
    """The held-out loss every reference run reports, for weights trained elsewhere (a real swarm)."""
    return _eval(setup, weights, _data(setup)[1])


def run_single(setup: SimSetup, *, steps: int, start: Named | None = None) -> SimResult:
    """One worker, batch_size per step, for steps steps."""
    t0 = time.monotonic()
    shards, heldout = _data(setup)
    weights = start if start is not None else start_weights(setup)
    result = train_inner(
        model_config=setup.model, base_weights=weights, data=b"".join(shards), steps=steps,
        batch_size=setup.batch_size, seed=derive_seed(TASK_ID, "single", setup.seed), adamw=setup.adamw,
    )
    loss = _eval(setup, result.weights, heldout)
    return SimResult(name="single", eval_loss=loss, samples=result.samples, bytes_per_node=0, seconds=time.monotonic() - t0)


def run_ddp(setup: SimSetup, *, workers: int, steps: int, start: Named | None = None) -> SimResult:
    """Synchronous data parallel: K workers' gradients averaged every step (a ring all-reduce)."""
    t0 = time.monotonic()
    shards, heldout = _data(setup)
    weights = start if start is not None else start_weights(setup)
    result = train_inner(
        model_config=setup.model, base_weights=weights, data=b"".join(shards), steps=steps,
        batch_size=workers * setup.batch_size, seed=derive_seed(TASK_ID, "ddp", setup.seed), adamw=setup.adamw,
    )
    model_bytes = 4 * sum(t.numel() for t in weights.values())
    sent = steps * 2 * (workers - 1) * model_bytes // workers
    loss = _eval(setup, result.weights, heldout)
    return SimResult(name="ddp", eval_loss=loss, samples=result.samples, bytes_per_node=sent, seconds=time.monotonic() - t0)


OVERLAPS = ("none", "rebase", "eager", "eager-mix")
"""How a worker trains through a round's exchange: not at all; as the task option ``overlap`` does, on from where
its inner steps ended; or from an eager-updates start point (Kale, Douillard and Donchev 2025): the outer step
its own update alone would give ("eager"), or that of its share of its update plus the others' share of the last
mean ("eager-mix"). The eager starts measured worse than "rebase" here (README), so the node offers only it."""


def run_diloco(
    setup: SimSetup,
    *,
    workers: int,
    rounds: int,
    inner_steps: int,
    compression: str = "int8",
    aggregate: str = "int8",
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    error_feedback: bool = False,
    start: Named | None = None,
    overlap: str = "none",
    ahead: float = 0.9,
    fragments: int = 1,
) -> SimResult:
    """DiLoCo rounds as the swarm runs them; bytes per node: one node's compressed update and its share of the
    mean, encoded by ``aggregate`` (reduce-scatter of each update to the aggregators, all-gather of the mean).

    With ``overlap`` (OVERLAPS) each worker takes ``ahead`` of a round's steps after sending its update, as
    if the exchange ran meanwhile, and rebases them onto the next round's weights (node/train/worker.py),
    which then trains only the rest of its steps. The outer optimizer left at None takes the compression's
    defaults, as a task spec does (protocol.task.outer_defaults).

    With ``fragments`` F > 1 (Streaming DiLoCo, as the task option does: node/tasks/fragments.py) round r syncs
    fragment r mod F of the model only, each worker trains on from its own weights (θ less its drift) and sends
    that fragment's whole progress since its last sync; the outer step moves that fragment alone."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
    if aggregate not in AGGREGATE_COMPRESSIONS:
        raise ValueError(f"aggregate must be one of {AGGREGATE_COMPRESSIONS}, got {aggregate!r}")
    if fragments > 1 and overlap != "none":
        raise ValueError("fragments and overlap do not combine (as in a task spec)")
    t0 = time.monotonic()
    shards, heldout = _data(setup)
    theta = start if start is not None else start_weights(setup)
    default_lr, default_momentum = outer_defaults(compression)
    outer = OuterNesterov(lr=default_lr if outer_lr is None else outer_lr,
                          momentum=default_momentum if outer_momentum is None else outer_momentum)
    peers = [f"peer-{i}" for i in range(workers)]
    loops: dict[str, InnerLoop] = {}
    carried: dict[str, tuple[Named, int]] = {}
    codec, out = CODECS.get(compression), CODECS[aggregate]
    feedback = {peer: ErrorFeedback(codec=codec) for peer in peers} \
        if codec is not None and (error_feedback or codec.feedback) else None
    up = 0
    samples = sent = 0
    steps_ahead = min(inner_steps, round(ahead * inner_steps)) if overlap != "none" else 0
    last_mean = None
    split = fragment_split([(n, theta[n].numel()) for n in sorted(theta)], fragments)
    drift: dict[str, Named] = {peer: {} for peer in peers}
    for round_index in range(rounds):
        names = split[round_index % fragments]
        assignment = assign_shards(TASK_ID, round_index, peers, setup.num_shards)
        updates = {}
        for peer in peers:
            loop = loops.get(peer)
            base = local_weights(theta, drift[peer])
            if loop is None:
                loop = loops[peer] = InnerLoop(model_config=setup.model, weights=base, adamw=setup.adamw)
            elif peer in carried:
                loop.rebase(theta, carried[peer][0])
            else:
                loop.load(base)
            done = carried.pop(peer, (None, 0))[1]
            loop.feed(b"".join(shards[i] for i in assignment[peer]), setup.batch_size,
                      derive_seed(TASK_ID, round_index, peer))
            for _ in range(inner_steps - done):
                loop.step()
            samples += inner_steps * setup.batch_size
            local, drift[peer] = streaming_update(pseudo_gradient(base, loop.weights()), drift[peer], names)
            delta, layout = flatten(local)
            if steps_ahead and round_index + 1 < rounds:
                if overlap == "eager":
                    ahead_from = _eager(theta, local, outer)
                elif overlap == "eager-mix":
                    ahead_from = _eager(theta, _mix(local, last_mean, layout, workers), outer)
                else:
                    ahead_from = loop.weights()
                loop.load(ahead_from)
                for _ in range(steps_ahead):
                    loop.step()
                carried[peer] = (ahead_from, steps_ahead)
            if codec is not None:  # below 8 bits and with top-k a node always keeps a residual (exchange.py)
                payload = feedback[peer].encode(f"fragment{round_index % fragments}", delta) if feedback \
                    else codec.encode(delta)
                delta = codec.decode(payload, delta.numel())
                up += len(payload)
            updates[peer] = ({"delta": delta}, inner_steps * setup.batch_size)
        mean = weighted_mean_by_peer(updates)["delta"]
        if codec is not None:  # aggregators ship the mean encoded by the task's aggregate codec
            payload = out.encode(mean)
            mean = out.decode(payload, mean.numel())
            sent += up // workers + len(payload)
            up = 0
        else:
            sent += 2 * 4 * mean.numel()
        theta = {**theta, **outer.step({n: theta[n] for n in names}, unflatten(mean, layout))}
        last_mean = mean
    loss = _eval(setup, theta, heldout)
    name = f"diloco-{compression}" + ("" if overlap == "none" else f"-{overlap}") + \
        ("" if fragments == 1 else f"-f{fragments}")
    return SimResult(name=name, eval_loss=loss, samples=samples, bytes_per_node=sent, seconds=time.monotonic() - t0)


def _mix(local: Named, last_mean, layout, workers: int) -> Named:
    """Kale et al.'s proxy for the round's mean: this worker's share of its own update, the others' the last mean."""
    if last_mean is None:
        return {n: t / workers for n, t in local.items()}
    others = unflatten(last_mean, layout)
    return {n: t / workers + others[n] * (1 - 1 / workers) for n, t in local.items()}


def _eager(theta: Named, delta: Named, outer: OuterNesterov) -> Named:
    """The outer step one worker's own update alone would give, the optimizer left as it is."""
    probe = OuterNesterov(lr=outer.lr, momentum=outer.momentum)
    probe.buffers = dict(outer.buffers)
    return probe.step(theta, delta)


def compare(setup: SimSetup, *, workers: int, rounds: int, inner_steps: int, **diloco_options) -> list[SimResult]:
    """The three runs from one start on the same total samples: K·R·H·batch_size sequences each."""
    start = start_weights(setup)
    return [
        run_single(setup, steps=workers * rounds * inner_steps, start=start),
        run_ddp(setup, workers=workers, steps=rounds * inner_steps, start=start),
        run_diloco(setup, workers=workers, rounds=rounds, inner_steps=inner_steps, start=start, **diloco_options),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--num-shards", type=int, default=64)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--compression", choices=COMPRESSIONS, default="int8")
    parser.add_argument("--aggregate", choices=AGGREGATE_COMPRESSIONS, default="int8")
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--overlap", choices=OVERLAPS, default="none")
    parser.add_argument("--ahead", type=float, default=0.9, help="with --overlap: the share of a round's steps "
                        "taken while the exchange runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = ModelConfig(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, seq_len=args.seq_len)
    setup = SimSetup(
        model=model, adamw=AdamWConfig(lr=args.lr, warmup_steps=args.warmup_steps), batch_size=args.batch_size,
        num_shards=args.num_shards, pretrain_steps=args.pretrain_steps,
    )
    print(f"params {num_params(init_model(model, 0))}  {dataclasses.asdict(setup)}")
    results = compare(
        setup, workers=args.workers, rounds=args.rounds, inner_steps=args.inner_steps,
        compression=args.compression, aggregate=args.aggregate, outer_lr=args.outer_lr,
        error_feedback=args.error_feedback, overlap=args.overlap, ahead=args.ahead,
    )
    for r in results:
        print(f"{r.name:12s} loss {r.eval_loss:.4f}  samples {r.samples}  bytes/node {r.bytes_per_node:,}  {r.seconds:.1f}s")
    ddp, diloco = results[1], results[2]
    print(f"diloco/ddp loss {diloco.eval_loss / ddp.eval_loss:.4f}  ddp/diloco bytes {ddp.bytes_per_node / diloco.bytes_per_node:.1f}x")


if __name__ == "__main__":
    main()
