"""The training checks' measures (node/tasks/training_check.py decides by them), for tiny-lm tasks: run in the
trainer child (its "gain" request, ``handle``), which holds no network and shares no GIL with the daemon.

    gain = loss(θ_r, B) − loss(θ_r − Δ̂, B)     B: the first CHECK_BATCHES batches a producer's inner steps drew

A loss is one forward of the batches together through a kept TinyLM on the meta device, the weights passed in
(torch.func.functional_call): nothing is built or copied per measure.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.func import functional_call

from node.train.data import batches, read_ranges
from node.train.diloco import Named, flatten, load_named, unflatten
from node.train.model import VOCAB_SIZE, ModelConfig, TinyLM

CHECK_BATCHES = 4
"""Batches of the producer's round its gain is measured on: its first inner steps'."""
COPY_BATCHES = 16
"""Batches each side of a near-copy pair is measured on (own_advantage), fewer if the producer took fewer
steps: the comparison runs only for producers the screen left out as near copies, and needs the power."""


def own_batches(data: bytes, seq_len: int, batch_size: int, seed: int, steps: int,
                count: int = CHECK_BATCHES) -> list[torch.Tensor]:
    """The first min(count, steps) batches the producer's inner steps drew from ``data``."""
    sampler = batches(data, seq_len, batch_size, seed)
    return [next(sampler) for _ in range(max(1, min(count, steps)))]


_modules = threading.local()


def _module(config: ModelConfig) -> TinyLM:
    """A TinyLM of ``config`` on the meta device, kept per thread: its weights are passed to each call
    (functional_call swaps them in for the call, so a module is never shared between threads)."""
    kept = getattr(_modules, "kept", None)
    if kept is None or kept[0] != config:
        with torch.device("meta"):
            kept = _modules.kept = (config, TinyLM(config).eval())
    return kept[1]


@torch.no_grad()
def _loss(config: ModelConfig, weights: Named, batches_: list[torch.Tensor]) -> float:
    """Mean next-byte loss over the batches (equal shapes: the mean of their means), in one forward."""
    whole = torch.cat(batches_)
    logits = functional_call(_module(config), weights, (whole[:, :-1],), strict=True)
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), whole[:, 1:].reshape(-1)).item()


def _moved(base: Named, delta_flat: torch.Tensor) -> Named:
    """θ − Δ̂, with ``delta_flat`` in sorted-name order (diloco.flatten)."""
    flat, layout = flatten(base)
    if delta_flat.numel() != flat.numel():
        raise ValueError(f"an update of {delta_flat.numel()} values does not fit weights of {flat.numel()}")
    return unflatten(flat - delta_flat.to(torch.float32), layout)


def own_gain(config: ModelConfig, base: Named, delta_flat: torch.Tensor, batches_: list[torch.Tensor],
             base_loss: float | None = None) -> float:
    """loss(base) − loss(base − Δ̂) on the batches; ``base_loss``: loss(base) on them, when already measured."""
    moved = _moved(base, delta_flat)
    before = _loss(config, base, batches_) if base_loss is None else base_loss
    return before - _loss(config, moved, batches_)


def own_advantage(config: ModelConfig, base: Named, delta_flat: torch.Tensor, reference_flat: torch.Tensor,
                  own: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """How much better an update fits its producer's batches than another producer's, beyond what the round's
    applied mean update (``reference_flat``, trained on neither) shows of how much easier either set is to
    improve: [gain(Δ, own) − gain(Δ, other)] − [gain(R, own) − gain(R, other)]. An honest update scores above
    0 (its batches shaped it); an exact copy of the other's scores the original's advantage negated."""
    at_own, at_other = _loss(config, base, own), _loss(config, base, other)
    return (own_gain(config, base, delta_flat, own, at_own) - own_gain(config, base, delta_flat, other, at_other)) - \
        (own_gain(config, base, reference_flat, own, at_own) - own_gain(config, base, reference_flat, other, at_other))


def measure(config: ModelConfig, base: Named, delta_flat: torch.Tensor, reference_flat: torch.Tensor | None,
            drawn: dict[str, list[torch.Tensor]], producer: str, owners: list[str]) -> dict[str, float]:
    """Per owner in ``owners``: for ``producer``, its update's own gain on its first batches; for another, the
    update's own_advantage over that owner's batches, beside the round's applied mean ``reference_flat``.
    ``drawn``: per owner (the producer always), the first COPY_BATCHES batches it drew."""
    out = {}
    for owner in owners:
        if owner == producer:
            out[owner] = own_gain(config, base, delta_flat, drawn[producer][:CHECK_BATCHES])
        elif reference_flat is None:
            raise ValueError(f"measuring against {owner}'s batches needs the round's applied mean")
        else:
            out[owner] = own_advantage(config, base, delta_flat, reference_flat, drawn[producer], drawn[owner])
    return out


def handle(req: dict) -> dict:
    """The trainer's "gain" request for tiny-lm: {"model", "base_path", "delta_path", "reference_path"?,
    "data_path", "producer", "owners": [name, ...], "batches": {name: {"shard_ranges", "seed", "steps"}},
    "batch_size"} -> {"gains": {name: float}}."""
    config = ModelConfig.from_dict(req["model"])
    base = load_named(req["base_path"])
    delta = flatten(load_named(req["delta_path"]))[0]
    reference = flatten(load_named(req["reference_path"]))[0] if req.get("reference_path") else None
    producer, owners, batch_size = str(req["producer"]), [str(o) for o in req["owners"]], int(req["batch_size"])
    drawn = draw(req["data_path"], config.seq_len, batch_size, req["batches"], producer, owners)
    return {"gains": measure(config, base, delta, reference, drawn, producer, owners)}


def draw(data_path, seq_len: int, batch_size: int, wanted: dict, producer: str, owners: list[str]
         ) -> dict[str, list[torch.Tensor]]:
    """Per owner (and the producer), the first COPY_BATCHES batches it drew: ``wanted`` maps each to
    {"shard_ranges", "seed", "steps"}, byte ranges of ``data_path`` it read in that order."""
    if producer not in wanted or not set(owners) <= set(wanted):
        raise ValueError("every owner measured, and the producer, need their batches")
    return {name: own_batches(read_ranges(data_path, b["shard_ranges"]), seq_len, batch_size, int(b["seed"]),
                              int(b["steps"]), count=COPY_BATCHES)
            for name, b in wanted.items() if name == producer or name in owners}
