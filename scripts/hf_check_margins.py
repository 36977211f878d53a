#!/usr/bin/env python3
"""How far honest hf updates stay from the training check's threshold, and where cheats land, JSON out.

A tiny Llama (tokenizer trained here, random weights, scripts/tiny_hf.py) is fine-tuned by ``--producers``
honest producers in-process as a swarm trains it: each round every producer takes ``--inner-steps`` AdamW steps
from the round's weights on its rendezvous shards with its own seed and carried optimizer state, its update goes
through the task's codec (int4 with error feedback by default) and the mean through the outer Nesterov step. Per
producer and round it measures the gain a checker measures (node/train/recipes.py ``gain``, through the same
function the trainer child serves): loss(θ_r, B) − loss(θ_r − Δ̂, B) on the first batches the producer drew.
Beside the honest updates it measures what a cheat would send in the same round, and reports per method the
threshold (node/tasks/training_check.py UNTRAINED_GAIN_HF), the lowest honest gain, how many honest updates a node
would accuse (must be 0), and the share of each cheat it would catch:

    stale    the producer's own update of the first round, sent again
    noise    Gaussian values at the norm of its honest update
    copy     another producer's update of the round, judged on this producer's batches

    python scripts/hf_check_margins.py --quick          # LoRA, 4 producers, 4 rounds: about 1 min here
    python scripts/hf_check_margins.py --json-out docs/bench/hf-check-margins.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from node.dataset import encode_records, split_records  # noqa: E402
from node.tasks import compute, training_check  # noqa: E402
from node.train import dpo, hf, recipes  # noqa: E402
from node.train.codecs import CODECS  # noqa: E402
from node.train.data import derive_seed  # noqa: E402
from node.train.diloco import OuterNesterov, flatten, pseudo_gradient, save_named, unflatten  # noqa: E402
from node.train.inner import AdamWConfig  # noqa: E402
from protocol.rendezvous import assign_shards  # noqa: E402
from scripts.tiny_hf import make_model_dir, pair_records, text_records  # noqa: E402

LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]
TASK = "hf-check-margins"


def run(method: str, producers: int, steps: int, rounds: int, seed: int, codec_name: str, work: Path) -> dict:
    model_dir = work / "model"
    if not model_dir.exists():
        make_model_dir(model_dir, arch="llama", seed=0)
    data = work / "records.bin"
    preference = method == "dpo"  # hf-dpo, which trains LoRA adapters
    records = pair_records(300, seed=5) if preference else text_records(400, seed=5)
    data.write_bytes(encode_records(records))
    shards, _ = split_records(len(records), 2 * producers, 0.1)
    lora = method == "lora"  # the demo's settings (scripts/demo_finetune.py task_fields)
    config = hf.HFConfig(recipe="hf-dpo" if preference else "hf-causal-lm", model_dir=str(model_dir),
                         method="full" if method == "full" else "lora", seq_len=48,
                         target_modules=() if method == "full" else tuple(LORA_TARGETS))
    make = dpo.loss_fn if preference else hf.causal_loss_fn
    adamw = AdamWConfig(lr=3e-2 if lora else 3e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, warmup_steps=0)
    outer = OuterNesterov(lr=0.5 if lora else 0.7, momentum=0.8 if lora else 0.9)
    theta = hf.initial_trainable(config, seed)
    model, trainable = hf.build(config)
    model.train()
    members = [f"p{i}-{seed}" for i in range(producers)]
    opt: dict[str, dict | None] = {m: None for m in members}
    residual: dict[str, dict | None] = {m: None for m in members}
    codec = CODECS[codec_name]
    first: dict[str, dict] = {}
    req = {"model": {"recipe": config.recipe, "model_dir": config.model_dir, "method": config.method,
                     "seq_len": config.seq_len, "target_modules": list(config.target_modules)},
           "data_path": str(data), "batch_size": 8, "count": training_check.CHECK_BATCHES}
    honest, cheats = [], {"stale": [], "noise": [], "copy": []}
    gen = torch.Generator().manual_seed(seed)
    for r in range(rounds):
        assigned = assign_shards(TASK, r, members, len(shards))
        deltas, own = {}, {}
        for m in members:
            hf.load_trainable(trainable, theta)
            ranges = [list(shards[i]) for i in assigned.get(m) or [derive_seed(TASK, r, m) % len(shards)]]
            chosen = [rec for a, b in ranges for rec in hf.records(str(data))[a:b]]
            s = derive_seed(TASK, r, m)
            out = hf.run_inner(trainable=trainable, loss_of=make(config, model, chosen, 8, s, "cpu"),
                               steps=steps, adamw=adamw, seed=s, batch_size=8, opt_state=opt[m], time_budget_s=None,
                               log_every=steps, progress=lambda *_: None)
            opt[m] = out["opt_state"]
            delta = pseudo_gradient(theta, out["weights"])
            if codec.feedback:
                payloads, residual[m] = compute.split_with_feedback(delta, 1, codec, residual[m])
            else:
                payloads = compute.split_update(delta, 1, codec)
            flat, layout = flatten(delta)
            deltas[m] = unflatten(compute.decode_slice(payloads[0], flat.numel(), codec), layout)
            own[m] = (ranges, s)
            first.setdefault(m, deltas[m])
        base = work / "base.safetensors"
        save_named(base, theta)

        def gain_of(delta: dict, m: str) -> float:
            path = work / "delta.safetensors"
            save_named(path, delta)
            ranges, s = own[m]
            return recipes.gain({**req, "base_path": str(base), "delta_path": str(path), "shard_ranges": ranges,
                                 "seed": s}, device="cpu")["gain"]

        for i, m in enumerate(members):
            honest.append(gain_of(deltas[m], m))
            norm = torch.sqrt(sum((t.float() ** 2).sum() for t in deltas[m].values()))
            noise = {n: torch.randn(t.shape, generator=gen) for n, t in deltas[m].items()}
            scale = norm / torch.sqrt(sum((t ** 2).sum() for t in noise.values()))
            cheats["noise"].append(gain_of({n: t * scale for n, t in noise.items()}, m))
            cheats["copy"].append(gain_of(deltas[members[(i + 1) % producers]], m))
            if r > 0:
                cheats["stale"].append(gain_of(first[m], m))
        mean = {n: sum(d[n] for d in deltas.values()) / producers for n in theta}
        theta = outer.step(theta, mean)
    return {"honest": honest, **cheats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="LoRA only, 4 producers, 4 rounds, 1 seed")
    parser.add_argument("--methods", default="lora,full",
                        help="lora and full: hf-causal-lm; dpo: hf-dpo with LoRA (not judged by nodes yet)")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--inner-steps", default="12,30,50")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--compression", default="int4", choices=sorted(CODECS))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    methods, steps_list = args.methods.split(","), [int(s) for s in args.inner_steps.split(",")]
    rounds, seeds = args.rounds, args.seeds
    if args.quick:
        methods, steps_list, rounds, seeds = ["lora"], [12], 4, 1
    started = time.monotonic()
    runs, methods_out = {}, {}
    with tempfile.TemporaryDirectory(prefix="shoal-hf-margins-") as tmp:
        for method in methods:
            threshold = training_check.UNTRAINED_GAIN_HF.get(method)
            pooled: dict[str, list[float]] = {}
            for steps in steps_list:
                for seed in range(seeds):
                    got = run(method, args.producers, steps, rounds, seed, args.compression, Path(tmp))
                    name = f"{method}/H={steps}/seed={seed}"
                    runs[name] = {k: {"min": round(min(v), 4), "max": round(max(v), 4)} for k, v in got.items() if v}
                    print(json.dumps({"run": name, **runs[name]}), file=sys.stderr, flush=True)
                    for k, v in got.items():
                        pooled.setdefault(k, []).extend(v)
            # What a node decides: an accusation needs the gain below the threshold by the tolerance.
            caught = {k: sum(threshold is not None and training_check.untrained(g, threshold) for g in v)
                      for k, v in pooled.items()}
            methods_out[method] = {
                "threshold": threshold,
                "min_honest_gain": round(min(pooled["honest"]), 4),
                "honest_accused": caught["honest"], "honest_updates": len(pooled["honest"]),
                "cheats": {k: {"max_gain": round(max(pooled[k]), 4),
                               "caught_share": round(caught[k] / len(pooled[k]), 3)}
                           for k in ("stale", "noise", "copy") if pooled.get(k)},
            }
    out = {
        "methods": methods_out,
        "producers": args.producers, "rounds": rounds, "inner_steps": steps_list, "seeds": seeds,
        "compression": args.compression, "runs": runs, "seconds": round(time.monotonic() - started, 1),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
