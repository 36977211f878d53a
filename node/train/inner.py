"""The inner loop of a DiLoCo round (AdamW for H steps or a time budget) and held-out evaluation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from node.train.data import batches
from node.train.diloco import Named, named_tensors
from node.train.model import VOCAB_SIZE, ModelConfig, TinyLM

if TYPE_CHECKING:
    from node.train.ranks import Ranks


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 0  # counted in optimizer steps, which persist with opt_state across rounds
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off

    def __post_init__(self):
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"adamw.lr must be > 0, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"adamw betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.eps <= 0 or self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError("adamw eps must be > 0 and weight_decay, warmup_steps, grad_clip >= 0")

    @classmethod
    def from_dict(cls, fields: dict) -> AdamWConfig:
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown adamw keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**fields)


@dataclass(kw_only=True)
class InnerResult:
    weights: Named
    opt_state: Named  # AdamW moments and step, to carry into this peer's next round
    steps: int
    samples: int
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, batch loss before it)
    seconds: float = 0.0


def resolve_device(name: str = "auto") -> torch.device:
    """"auto": the first CUDA device when one works, else the CPU; "cuda" insists on one."""
    if name == "cpu":
        return torch.device("cpu")
    if name in ("auto", "cuda"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if name == "cuda":
            raise ValueError("the task asks for a CUDA device, but torch sees none on this node")
        return torch.device("cpu")
    raise ValueError(f"device must be auto, cpu or cuda, not {name!r}")


def model_from_weights(config: ModelConfig, weights: Named, device: torch.device | str = "cpu") -> TinyLM:
    with torch.device("meta"):
        model = TinyLM(config)
    model.to_empty(device=device)
    model.load_state_dict(weights, strict=True)
    return model


def lm_loss(model: TinyLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats for a [B, T+1] batch."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))


def _load_opt_state(opt: torch.optim.AdamW, names: list[str], params: list, state: Named) -> None:
    expected = {f"{kind}.{n}" for n in names for kind in ("exp_avg", "exp_avg_sq")} | {"step"}
    if set(state) != expected:
        raise ValueError(f"optimizer state does not match the model: differs in {sorted(set(state) ^ expected)[:5]}")
    step = state["step"].to(torch.float32).reshape(())
    for name, p in zip(names, params):
        opt.state[p] = {
            "step": step.clone(),
            "exp_avg": state[f"exp_avg.{name}"].to(p.device, torch.float32).clone(),
            "exp_avg_sq": state[f"exp_avg_sq.{name}"].to(p.device, torch.float32).clone(),
        }


def _dump_opt_state(opt: torch.optim.AdamW, names: list[str], params: list) -> Named:
    out: Named = {}
    for name, p in zip(names, params):
        s = opt.state[p]
        out[f"exp_avg.{name}"] = s["exp_avg"].to("cpu").clone()
        out[f"exp_avg_sq.{name}"] = s["exp_avg_sq"].to("cpu").clone()
        out["step"] = s["step"].to("cpu", torch.float32).reshape(()).clone()
    return out


def whole_batch_loss(loss: torch.Tensor, ranks: Ranks | None) -> float:
    """The loss a node commits to: with ranks, the mean of their equal shares (a collective call)."""
    return ranks.mean(loss) if ranks is not None else loss.item()


def train_inner(
    *,
    model_config: ModelConfig,
    base_weights: Named,
    data: bytes,
    steps: int,
    batch_size: int,
    seed: int,
    adamw: AdamWConfig = AdamWConfig(),
    time_budget_s: float | None = None,
    opt_state: Named | None = None,
    log_every: int = 10,
    progress: Callable[[int, float], None] | None = None,
    device: torch.device | str = "cpu",
    ranks: Ranks | None = None,
) -> InnerResult:
    """Up to `steps` AdamW steps from base_weights on seeded batches of `data`.

    Stops early once time_budget_s has passed (after at least one step), so a slow device
    contributes fewer samples instead of stalling the round. Losses are recorded at step 0,
    every log_every steps and the last step: the commitment a validator replays. With ranks
    (node/train/ranks.py), this process trains on its share of each batch and the gradients and
    losses are the whole batch's.
    """
    if steps < 1 or log_every < 1:
        raise ValueError(f"steps and log_every must be >= 1, got {steps} and {log_every}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time_budget_s must be > 0, got {time_budget_s}")
    start = time.monotonic()
    model = model_from_weights(model_config, base_weights, device)
    model.train()
    names = sorted(n for n, _ in model.named_parameters())
    by_name = dict(model.named_parameters())
    params = [by_name[n] for n in names]
    # Weight decay on matrices only (nanoGPT): decaying gains and biases toward 0 only hurts.
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": adamw.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=adamw.lr, betas=(adamw.beta1, adamw.beta2), eps=adamw.eps, foreach=False)
    if opt_state:
        _load_opt_state(opt, names, params, opt_state)
    prior_steps = int(opt_state["step"].item()) if opt_state else 0

    losses: list[tuple[int, float]] = []
    sampler = batches(data, model_config.seq_len, batch_size, seed)
    done = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # dropout masks, when the config asks for dropout
        for step in range(steps):
            over = bool(step) and time_budget_s is not None and time.monotonic() - start >= time_budget_s
            if ranks.agree(over) if ranks is not None else over:
                break
            lr = adamw.lr * min(1.0, (prior_steps + step + 1) / adamw.warmup_steps) if adamw.warmup_steps else adamw.lr
            for group in opt.param_groups:
                group["lr"] = lr
            batch = next(sampler)
            loss = lm_loss(model, (ranks.share(batch) if ranks is not None else batch).to(device, non_blocking=True))
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
                if progress is not None:
                    progress(step, value)
    last_loss_step = done - 1
    if losses[-1][0] != last_loss_step:  # stopped early by the time budget (on every rank at once)
        losses.append((last_loss_step, whole_batch_loss(loss, ranks)))
    return InnerResult(
        weights=named_tensors(model),
        opt_state=_dump_opt_state(opt, names, params),
        steps=done,
        samples=done * batch_size,
        losses=losses,
        seconds=time.monotonic() - start,
    )


@torch.no_grad()
def evaluate(
    model_config: ModelConfig, weights: Named, heldout_bytes: bytes, num_batches: int, seed: int, batch_size: int = 8,
    device: torch.device | str = "cpu",
) -> float:
    """Mean next-byte cross-entropy (nats per byte) over num_batches seeded held-out batches."""
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    model = model_from_weights(model_config, weights, device)
    model.eval()
    sampler = batches(heldout_bytes, model_config.seq_len, batch_size, seed)
    total = math.fsum(lm_loss(model, next(sampler).to(device)).item() for _ in range(num_batches))
    return total / num_batches
