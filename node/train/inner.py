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
    from node.train.ranks import Ranks
    for name, p in zip(names, params):
        opt.state[p] = {
            "step": step.clone(),
            "exp_avg": Ranks.like(p, state[f"exp_avg.{name}"].to(torch.float32).clone()),
            "exp_avg_sq": Ranks.like(p, state[f"exp_avg_sq.{name}"].to(torch.float32).clone()),
        }


def _dump_opt_state(opt: torch.optim.AdamW, names: list[str], params: list) -> Named:
    from node.train.ranks import Ranks
    out: Named = {}
    for name, p in zip(names, params):
        s = opt.state[p]
        out[f"exp_avg.{name}"] = Ranks.full(s["exp_avg"]).to("cpu").clone()
        out[f"exp_avg_sq.{name}"] = Ranks.full(s["exp_avg_sq"]).to("cpu").clone()
        out["step"] = s["step"].to("cpu", torch.float32).reshape(()).clone()
    return out


def whole_batch_loss(loss: torch.Tensor, ranks: Ranks | None) -> float:
    """The loss a node commits to: with ranks, the mean of their equal shares (a collective call)."""
    return ranks.mean(loss) if ranks is not None else loss.item()


class InnerLoop:
    """AdamW steps on one model, one at a time, with the optimizer state carried between rounds.

    A round's inner steps run through it (train_inner), and so do the steps a node takes on its own
    data while its round's exchange is under way (task option ``overlap``): those are carried into
    its next round by ``rebase``, which moves the local model onto the round's new weights while
    keeping the progress made since the update was sent.
    """

    def __init__(self, *, model_config: ModelConfig, weights: Named, adamw: AdamWConfig = AdamWConfig(),
                 opt_state: Named | None = None, device: torch.device | str = "cpu", ranks: Ranks | None = None):
        self.config, self.adamw, self.device, self.ranks = model_config, adamw, device, ranks
        self.model = model_from_weights(model_config, weights, device if ranks is None else ranks.build_device())
        if ranks is not None:
            ranks.prepare(self.model)
        self.model.train()
        self.names = sorted(n for n, _ in self.model.named_parameters())
        by_name = dict(self.model.named_parameters())
        self.params = [by_name[n] for n in self.names]
        # Weight decay on matrices only (nanoGPT): decaying gains and biases toward 0 only hurts.
        groups = [
            {"params": [p for p in self.params if p.dim() >= 2], "weight_decay": adamw.weight_decay},
            {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=adamw.lr, betas=(adamw.beta1, adamw.beta2), eps=adamw.eps,
                                     foreach=False)
        if opt_state:
            _load_opt_state(self.opt, self.names, self.params, opt_state)
        self.taken = int(opt_state["step"].item()) if opt_state else 0
        """Optimizer steps so far, the carried state's included: the warmup counts them."""
        self.sampler = None
        self.batch_size = 0

    def feed(self, data: bytes, batch_size: int, seed: int) -> None:
        """Draw the next steps' batches from ``data``, in the order ``seed`` gives."""
        self.sampler = batches(data, self.config.seq_len, batch_size, seed)
        self.batch_size = batch_size

    def step(self) -> torch.Tensor:
        """One AdamW step on the next batch; the batch's loss before it (this rank's share with ranks)."""
        adamw, ranks = self.adamw, self.ranks
        lr = adamw.lr * min(1.0, (self.taken + 1) / adamw.warmup_steps) if adamw.warmup_steps else adamw.lr
        for group in self.opt.param_groups:
            group["lr"] = lr
        batch = next(self.sampler)
        loss = lm_loss(self.model, (ranks.share(batch) if ranks is not None else batch).to(self.device, non_blocking=True))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if ranks is not None:
            ranks.average_grads(self.params)
        if adamw.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, adamw.grad_clip)
        self.opt.step()
        self.taken += 1
        return loss

    @torch.no_grad()
    def rebase(self, base: Named, sent: Named) -> None:
        """θ_local ← base + (θ_local − sent): onto the round's new weights, keeping the steps taken since
        ``sent`` (the weights the last update was computed to). The next update, base − θ_local, then
        carries those steps once."""
        if set(base) != set(self.names) or set(sent) != set(self.names):
            raise ValueError("rebase: the weights do not match the model's parameters")
        for name, p in zip(self.names, self.params):
            p.add_(base[name].to(p.device) - sent[name].to(p.device))

    @torch.no_grad()
    def load(self, weights: Named) -> None:
        """Move the local model to ``weights`` (the optimizer state stays)."""
        if set(weights) != set(self.names):
            raise ValueError("load: the weights do not match the model's parameters")
        for name, p in zip(self.names, self.params):
            p.copy_(weights[name].to(p.device))

    def weights(self) -> Named:
        return named_tensors(self.model)

    def opt_state(self) -> Named:
        return _dump_opt_state(self.opt, self.names, self.params)


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
    loop: InnerLoop | None = None,
) -> InnerResult:
    """Up to `steps` AdamW steps from base_weights on seeded batches of `data`.

    Stops early once time_budget_s has passed (after at least one step), so a slow device
    contributes fewer samples instead of stalling the round. Losses are recorded at step 0,
    every log_every steps and the last step: the commitment a validator replays. With ranks
    (node/train/ranks.py), this process trains on its share of each batch and the gradients and
    losses are the whole batch's. With ``loop``, the steps continue that loop (already on
    base_weights, with its optimizer state) instead of a new one, and it is left for more.
    """
    if steps < 1 or log_every < 1:
        raise ValueError(f"steps and log_every must be >= 1, got {steps} and {log_every}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time_budget_s must be > 0, got {time_budget_s}")
    start = time.monotonic()
    if loop is None:
        loop = InnerLoop(model_config=model_config, weights=base_weights, adamw=adamw, opt_state=opt_state,
                         device=device, ranks=ranks)
    loop.feed(data, batch_size, seed)

    losses: list[tuple[int, float]] = []
    done = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # dropout masks, when the config asks for dropout
        for step in range(steps):
            over = bool(step) and time_budget_s is not None and time.monotonic() - start >= time_budget_s
            if ranks.agree(over) if ranks is not None else over:
                break
            loss = loop.step()
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
        weights=loop.weights(),
        opt_state=loop.opt_state(),
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
