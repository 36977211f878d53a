"""The recipe registry of the trainer child: what builds the model, feeds batches, computes the loss, picks
the trainable tensors. ``tiny-lm`` stays in worker.py; the hf-* recipes are served here.

Requests (node/train/worker.py frames) for the hf-* recipes carry ``model`` = HFConfig's fields and
``data_path`` = a canonical records file (node/dataset.py); ranges are record ranges, not bytes:

    {"op": "prepare", "model", "data_path", "seed", "out_path"}
      -> {"num_params", "total_params", "weight_bytes", "num_records", "memory_estimate_bytes"}
    {"op": "train", "model", "base_path", "data_path", "shard_ranges", ...as tiny-lm}
    {"op": "eval", "model", "weights_path", "data_path", "data_range", "num_batches", "batch_size"}
      -> {"loss", "margin"?}
    {"op": "gain", "model", "base_path", "delta_path", "data_path", "shard_ranges", "seed", "batch_size", "count"}
      -> {"gain", "loss"}: an update's loss drop on the first batches its producer drew (training checks)
"""

from __future__ import annotations

import os

from node.train.hf import HFConfig

HF_RECIPES = ("hf-causal-lm", "hf-dpo")


def is_hf(model: dict) -> bool:
    return model.get("recipe") in HF_RECIPES


def _config(req: dict) -> HFConfig:
    model = req.get("model")
    if not isinstance(model, dict):
        raise ValueError("request is missing 'model'")
    config = HFConfig.from_dict(model)
    if config.recipe not in HF_RECIPES:
        raise ValueError(f"unknown recipe {config.recipe!r}; the trainer serves tiny-lm and {list(HF_RECIPES)}")
    if config.recipe == "hf-dpo" and config.method != "lora":
        raise ValueError("hf-dpo needs hf.method = \"lora\": the reference model is the base with the adapter off")
    return config


def prepare(req: dict) -> dict:
    """Load the model and dataset once, check they fit together, write θ_0 (the trainable tensors) to out_path."""
    from node.train import hf
    from node.train.diloco import save_named
    config = _config(req)
    recs = hf.records(req["data_path"])
    hf.check_records_fit(config, recs)
    vocab = hf._tokenizer(config.model_dir).get_vocab_size(with_added_tokens=True)
    model, trainable = hf.build(config)
    embed_rows = model.get_input_embeddings().weight.shape[0]
    if vocab > embed_rows:
        raise ValueError(f"the tokenizer does not match the model: {vocab} tokens, {embed_rows} embedding rows")
    total = sum(p.numel() for p in model.parameters())
    del model
    weights = hf.initial_trainable(config, int(req["seed"]))
    save_named(req["out_path"], weights)
    trained = sum(t.numel() for t in weights.values())
    factor = hf.MEMORY_FACTOR_FULL
    return {"num_params": trained, "total_params": total, "num_records": len(recs),
            "memory_estimate_bytes": 4 * (total + factor * trained) + (256 << 20)}


def train(req: dict, *, device, progress, ranks=None) -> dict:
    from node.train import dpo, hf
    from node.train.diloco import load_named, pseudo_gradient, save_named
    from node.train.inner import AdamWConfig
    from node.train.ranks import device_label
    config = _config(req)
    adamw = AdamWConfig.from_dict(req.get("adamw") or {})
    base = load_named(req["base_path"])
    recs = hf.records(req["data_path"])
    chosen = [r for a, b in hf.check_ranges(req.get("shard_ranges"), len(recs)) for r in recs[a:b]]
    model, trainable = hf.built(config, device) if ranks is None else hf.build(config, ranks.build_device())
    hf.load_trainable(trainable, base)
    if ranks is not None and ranks.shard:
        ranks.prepare(model)
        trainable = {n: p for n, p in sorted(model.named_parameters()) if p.requires_grad}
    model.train()
    batch_size, seed = int(req["batch_size"]), int(req["seed"])
    make = dpo.loss_fn if config.recipe == "hf-dpo" else hf.causal_loss_fn
    opt_path = req.get("opt_state_path")
    result = hf.run_inner(
        trainable=trainable, loss_of=make(config, model, chosen, batch_size, seed, device, ranks),
        steps=int(req["steps"]), adamw=adamw, seed=seed, batch_size=batch_size,
        opt_state=load_named(opt_path) if opt_path and os.path.exists(opt_path) else None,
        time_budget_s=req.get("time_budget_s"), log_every=int(req.get("log_every") or 10), progress=progress,
        ranks=ranks)
    if ranks is not None and ranks.rank != 0:
        return {}
    delta = pseudo_gradient(base, result["weights"])
    save_named(req["out_path"], delta)
    opt_out = req.get("opt_state_out") or opt_path
    if opt_out:
        save_named(opt_out, result["opt_state"])
    return {"samples": result["samples"], "steps": result["steps"], "losses": [[s, x] for s, x in result["losses"]],
            "seconds": result["seconds"], "out_path": req["out_path"], "device": device_label(device, ranks)}


def evaluate(req: dict, *, device) -> dict:
    from node.train import dpo, hf
    from node.train.diloco import load_named
    config = _config(req)
    recs = hf.records(req["data_path"])
    (start, end), = hf.check_ranges([req.get("data_range")], len(recs))
    model, trainable = hf.built(config, device)
    hf.load_trainable(trainable, load_named(req["weights_path"]))
    count = int(req["num_batches"]) * int(req.get("batch_size") or 8)
    if config.recipe == "hf-dpo":
        return dpo.evaluate(config, model, recs[start:end], count, device)
    return {"loss": hf.evaluate_causal(config, model, recs[start:end], count, device)}


def gain(req: dict, *, device) -> dict:
    """An update's own-data gain, loss(θ_r, B) − loss(θ_r − Δ, B), on B: the first ``count`` batches a producer's
    inner steps drew from its records with its seed (the hf side of node/tasks/training_check.py ``own_gain``).
    Losses are the recipe's own (causal: nats per token; DPO: per pair), the model in eval mode."""
    import math

    import torch

    from node.train import dpo, hf
    from node.train.diloco import load_named
    config = _config(req)
    base, delta = load_named(req["base_path"]), load_named(req["delta_path"])
    if {n: tuple(t.shape) for n, t in base.items()} != {n: tuple(t.shape) for n, t in delta.items()}:
        raise ValueError("the update's tensors do not match the round's weights")
    recs = hf.records(req["data_path"])
    chosen = [r for a, b in hf.check_ranges(req.get("shard_ranges"), len(recs)) for r in recs[a:b]]
    count, batch_size, seed = int(req["count"]), int(req["batch_size"]), int(req["seed"])
    if count < 1:
        raise ValueError("count must be at least 1")
    model, trainable = hf.built(config, device)
    model.eval()
    make = dpo.loss_fn if config.recipe == "hf-dpo" else hf.causal_loss_fn

    @torch.no_grad()
    def loss_with(weights) -> float:
        hf.load_trainable(trainable, weights)
        loss_of = make(config, model, chosen, batch_size, seed, device)
        return math.fsum(loss_of(step).item() for step in range(count)) / count

    before = loss_with(base)
    after = loss_with({n: base[n].to(torch.float32) - delta[n].to(torch.float32) for n in base})
    return {"gain": before - after, "loss": before}
