"""TinyLM: a small causal transformer over bytes, with a seeded, deterministic init."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256  # bytes
MAX_LAYERS = 64
MAX_D_MODEL = 8192
MAX_SEQ_LEN = 65536


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_layer > MAX_LAYERS or self.d_model > MAX_D_MODEL or self.seq_len > MAX_SEQ_LEN:
            raise ValueError(
                f"model too large: n_layer <= {MAX_LAYERS}, d_model <= {MAX_D_MODEL}, "
                f"seq_len <= {MAX_SEQ_LEN}; got {self.n_layer}, {self.d_model}, {self.seq_len}"
            )
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def from_dict(cls, fields: dict) -> ModelConfig:
        """From a wire or config map; unknown keys are a mistake, not something to ignore."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        return cls(**fields)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = nn.Linear(config.d_model, 3 * config.d_model)
        self.attn_proj = nn.Linear(config.d_model, config.d_model)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Linear(config.d_model, 4 * config.d_model)
        self.mlp_proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.dropout(self.attn_proj(y), dropout_p, self.training)
        h = self.mlp_proj(F.gelu(self.mlp(self.ln_2(x))))
        return x + F.dropout(h, dropout_p, self.training)


class TinyLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB_SIZE, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 style init drawn from one generator in sorted-name order, so a seed fixes every bit."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in sorted(self.named_parameters()):
            if name.startswith("ln_") or ".ln_" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = residual_std if name.endswith("_proj.weight") else 0.02
                p.normal_(0.0, std, generator=gen)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, 256] for byte ids [B, T]."""
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence of {T} bytes is longer than model.seq_len {self.config.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = F.dropout(self.tok_emb(idx) + self.pos_emb(pos), self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def init_model(config: ModelConfig, seed: int) -> TinyLM:
    """A fresh model on CPU; built on the meta device first so the global RNG is never touched."""
    with torch.device("meta"):
        model = TinyLM(config)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
