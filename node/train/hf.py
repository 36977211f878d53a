"""Causal LMs from ``transformers`` in the trainer child: build (full or LoRA through peft), tokenize, train, evaluate.

The model comes from a checked local directory (node/bundle.py): safetensors only, no remote code.
What a round exchanges are the *trainable* tensors by name: every parameter for full fine-tuning,
only the LoRA adapter's for "lora" (the base stays frozen and identical on every node).
"""

from __future__ import annotations

import functools
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from node.dataset import decode_records, is_pairs
from node.train.diloco import Named, named_tensors
from node.train.inner import AdamWConfig, _dump_opt_state, _load_opt_state, whole_batch_loss

MEMORY_FACTOR_FULL = 6
"""Bytes per trained float32 value, in units of 4: weights, grad, two AdamW moments, outer momentum, base copy."""


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    """The trainer's view of a task's hf table (protocol/task.py HFSpec) plus where the model directory is."""

    recipe: str
    model_dir: str
    method: str = "lora"
    seq_len: int = 128
    lora_r: int = 8
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = ()
    dpo_beta: float = 0.1

    @classmethod
    def from_dict(cls, fields: dict) -> HFConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown hf model keys {unknown}; known: {sorted(known)}")
        return cls(**{**fields, "target_modules": tuple(fields.get("target_modules") or ())})


def _quiet():
    # transformers and peft warn about things that do not apply to a tiny local model (no hub, no GPU).
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_base(model_dir: str, device: torch.device | str = "cpu"):
    """The model in model_dir: safetensors weights, built-in architecture only, float32, nothing fetched."""
    _quiet()
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True, trust_remote_code=False,
                                                 local_files_only=True, dtype=torch.float32)
    return model.to(device)


def build(config: HFConfig, device: torch.device | str = "cpu"):
    """(model, trainable parameters by sorted name): the base as loaded, wrapped in LoRA when asked."""
    model = load_base(config.model_dir, device)
    if config.method == "lora":
        import peft
        lora = peft.LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                               target_modules=list(config.target_modules) or None, bias="none")
        try:
            model = peft.get_peft_model(model, lora)
        except ValueError as exc:
            raise ValueError(f"LoRA does not fit this model: {exc}") from None
    trainable = {n: p for n, p in sorted(model.named_parameters()) if p.requires_grad}
    return model, trainable


_built: dict = {}
"""The worker's one kept model (``built``): key -> (model, trainable)."""


def built(config: HFConfig, device: torch.device | str = "cpu"):
    """``build``'s (model, trainable), kept for the next request of the same model in this trainer child:
    a round trains, evaluates and checks others' updates with one model, and loading it each time cost more
    than the work at small sizes. Every user loads the trainable tensors it needs (load_trainable) and sets
    train or eval mode; the frozen rest is never written (LoRA's base; full fine-tuning trains every
    parameter). Keyed by the config, the device and the model files' sizes and times, so a changed directory
    is loaded again; one model is kept at a time."""
    files = sorted(Path(config.model_dir).glob("*"))
    key = (config, str(device), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()))
    if key not in _built:
        _built.clear()  # the old model's memory goes before the new one is loaded
        _built[key] = build(config, device)
    model, trainable = _built[key]
    for p in trainable.values():
        p.grad = None
    return model, trainable


def forget() -> None:
    """Drop the kept model (``built``), before work that holds its own copies: ranks training on the devices."""
    _built.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def initial_trainable(config: HFConfig, seed: int) -> Named:
    """θ_0 of what a round exchanges. LoRA: A drawn from one seeded generator in sorted-name order (peft's
    kaiming-uniform bound 1/sqrt(fan_in)), B zero, so the adapter starts as a no-op on every node alike."""
    model, trainable = build(config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in trainable.items():
        t = p.detach().to("cpu", torch.float32).clone()
        if config.method == "lora":
            if ".lora_A." in name:
                bound = 1.0 / math.sqrt(t.shape[1])
                t = torch.rand(t.shape, generator=gen, dtype=torch.float32) * (2 * bound) - bound
            elif ".lora_B." in name:
                t = torch.zeros_like(t)
        out[name] = t.contiguous()
    del model
    return out


def load_trainable(trainable: dict, weights: Named) -> None:
    if set(trainable) != set(weights):
        diff = sorted(set(trainable) ^ set(weights))
        raise ValueError(f"weights do not match the model's trainable tensors: differ in {diff[:4]}")
    with torch.no_grad():
        for name, p in trainable.items():
            if tuple(p.shape) != tuple(weights[name].shape):
                raise ValueError(f"{name}: shape {tuple(weights[name].shape)}, the model has {tuple(p.shape)}")
            p.copy_(weights[name].to(p.device, p.dtype))


def model_with(config: HFConfig, weights: Named, device: torch.device | str = "cpu"):
    """The model with a round's trainable tensors in place (what export and the logits check use)."""
    model, trainable = build(config, device)
    load_trainable(trainable, weights)
    return model


# -- data ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def _eos_id(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if not isinstance(eos, int):
        raise ValueError("config.json has no eos_token_id, which separates records in the token stream")
    return eos


def encode(model_dir: str, text: str) -> list[int]:
    return _tokenizer(model_dir).encode(text, add_special_tokens=False).ids


@functools.lru_cache(maxsize=4)
def _records(path: str, size: int, mtime_ns: int) -> list[dict]:
    return decode_records(Path(path).read_bytes())


def records(path: str) -> list[dict]:
    st = Path(path).stat()
    return _records(path, st.st_size, st.st_mtime_ns)


def check_ranges(ranges, num_records: int) -> list[tuple[int, int]]:
    if not isinstance(ranges, list) or not ranges:
        raise ValueError("shard_ranges must be a non-empty list of [start, end] record ranges")
    out = []
    for r in ranges:
        if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)
                and 0 <= r[0] < r[1] <= num_records):
            raise ValueError(f"record range {r!r} is not [start, end) inside {num_records} records")
        out.append((r[0], r[1]))
    return out


def token_stream(model_dir: str, recs: list[dict]) -> torch.Tensor:
    """Records' tokens, each followed by EOS, as one LongTensor: the same on every node for the same file."""
    eos = _eos_id(model_dir)
    ids: list[int] = []
    for r in recs:
        ids += encode(model_dir, r["text"]) + [eos]
    return torch.tensor(ids, dtype=torch.long)


def lm_windows(stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
    window = seq_len + 1
    if stream.numel() < window:
        raise ValueError(f"{stream.numel()} tokens are fewer than one window of {window}: use more records or a "
                         "shorter hf.seq_len")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(window)
    while True:
        starts = torch.randint(0, stream.numel() - window + 1, (batch_size,), generator=gen)
        yield stream[starts[:, None] + offsets]


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


# -- the inner loop ------------------------------------------------------------------------------

def run_inner(*, trainable: dict, loss_of, steps: int, adamw: AdamWConfig, seed: int, batch_size: int,
              opt_state: Named | None, time_budget_s: float | None, log_every: int, progress, ranks=None) -> dict:
    """AdamW on the trainable tensors for up to ``steps`` steps (nanoGPT decay groups, warmup, clipping).

    With ranks (node/train/ranks.py) loss_of gives this rank's share of the batch; gradients and the
    committed losses are averaged over the ranks."""
    start = time.monotonic()
    names = list(trainable)
    params = [trainable[n] for n in names]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": adamw.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=adamw.lr, betas=(adamw.beta1, adamw.beta2),
                            eps=adamw.eps, foreach=False)
    if opt_state:
        _load_opt_state(opt, names, params, opt_state)
    prior = int(opt_state["step"].item()) if opt_state else 0
    losses: list[tuple[int, float]] = []
    done = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            over = bool(step) and time_budget_s is not None and time.monotonic() - start >= time_budget_s
            if ranks.agree(over) if ranks is not None else over:
                break
            lr = adamw.lr * min(1.0, (prior + step + 1) / adamw.warmup_steps) if adamw.warmup_steps else adamw.lr
            for group in opt.param_groups:
                group["lr"] = lr
            loss = loss_of(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if ranks is not None:
                ranks.average_grads(params)
            if adamw.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, adamw.grad_clip)
            opt.step()
            done = step + 1
            if step % log_every == 0 or done == steps:
                value = whole_batch_loss(loss, ranks)
                losses.append((step, value))
                progress(step, value)
    if losses[-1][0] != done - 1:
        losses.append((done - 1, whole_batch_loss(loss, ranks)))
    return {"weights": named_tensors(trainable),
            "opt_state": _dump_opt_state(opt, names, params), "steps": done, "samples": done * batch_size,
            "losses": losses, "seconds": time.monotonic() - start}


def causal_loss_fn(config: HFConfig, model, recs: list[dict], batch_size: int, seed: int, device, ranks=None):
    sampler = lm_windows(token_stream(config.model_dir, recs), config.seq_len, batch_size, seed)
    if ranks is not None:
        return lambda step: lm_loss(model, ranks.share(next(sampler)).to(device))
    return lambda step: lm_loss(model, next(sampler).to(device))


@torch.no_grad()
def evaluate_causal(config: HFConfig, model, recs: list[dict], num_windows: int, device) -> float:
    """Mean next-token cross-entropy (nats/token) over the first num_windows non-overlapping held-out windows."""
    model.eval()
    stream = token_stream(config.model_dir, recs)
    window = config.seq_len + 1
    count = min(num_windows, stream.numel() // window)
    if count < 1:
        raise ValueError(f"the held-out split has {stream.numel()} tokens, fewer than one window of {window}")
    batch = stream[: count * window].view(count, window).to(device)
    return float(lm_loss(model, batch).item())


def check_records_fit(config: HFConfig, recs: list[dict]) -> None:
    wants_pairs = config.recipe == "hf-dpo"
    if is_pairs(recs) != wants_pairs:
        raise ValueError(f"recipe {config.recipe} trains on {'prompt/chosen/rejected pairs' if wants_pairs else 'text'}"
                         f" records, and this dataset holds {'pairs' if is_pairs(recs) else 'text'}")
