"""The tensor side of a round, run in threads: slices, int8 payloads, aggregation, the outer step, checkpoints."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from node.fsutil import fsync_dir, write_atomic
from node.train.compress import check_int8, decode_int8, encode_int8, encoded_size, tensor_bytes
from node.train.diloco import (Named, OuterNesterov, flatten, load_named, named_tensors, save_named, unflatten,
                               weights_hash)
from node.train.model import ModelConfig, init_model
from protocol.errors import IntegrityError
from protocol.manifest import Manifest
from protocol.task import TaskSpec

PAYLOAD = "int8"
"""The one tensor in a slice manifest: the int8 payload as raw uint8 bytes."""
MOMENTUM_PREFIX = "momentum."


def model_config(spec: TaskSpec) -> ModelConfig:
    m = spec.model
    return ModelConfig(n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model, seq_len=m.seq_len)


def initial_weights(spec: TaskSpec) -> Named:
    if spec.hf is not None:
        from node.tasks.hf_task import initial_weights as hf_initial  # drawn by the trainer child
        return hf_initial(spec)
    return named_tensors(init_model(model_config(spec), spec.seed))


def slice_bounds(numel: int, num_slices: int) -> list[tuple[int, int]]:
    return [(numel * i // num_slices, numel * (i + 1) // num_slices) for i in range(num_slices)]


def payload_tensor(data: bytes) -> dict[str, torch.Tensor]:
    return {PAYLOAD: torch.frombuffer(bytearray(data), dtype=torch.uint8)}


def split_update(delta: Named, num_slices: int) -> list[bytes]:
    """Δ flattened in sorted-name order, cut into slices, each int8-encoded."""
    flat, _ = flatten(delta)
    return [encode_int8(flat[a:b].contiguous()) for a, b in slice_bounds(flat.numel(), num_slices)]


def payload_bytes(manifest: Manifest, tensors: dict[str, torch.Tensor], numel: int) -> bytes:
    """The int8 payload of a slice manifest; IntegrityError unless it is exactly one tensor of the right size."""
    expected = encoded_size(numel)
    entries = manifest.tensors
    if len(entries) != 1 or entries[0].name != PAYLOAD or entries[0].dtype != "uint8" \
            or entries[0].shape != (expected,):
        shapes = [(e.name, e.dtype, e.shape) for e in entries]
        raise IntegrityError(f"slice payload must be one uint8 tensor {PAYLOAD!r} of {expected} bytes, got {shapes}")
    return tensor_bytes(tensors[PAYLOAD])


def decode_slice(data: bytes, numel: int) -> torch.Tensor:
    try:
        return decode_int8(data, numel)
    except ValueError as exc:
        raise IntegrityError(f"bad int8 slice: {exc}") from None


def aggregate(slices: dict[str, tuple[bytes, int]], numel: int) -> tuple[bytes, str, list[str]]:
    """Weighted mean (by samples, sorted producer order) of the slices, int8-encoded, its hash, and the
    producers whose slice did not decode (left out). Streams: one decoded slice in memory at a time,
    with the same operations in the same order as diloco.weighted_mean, so every aggregator agrees."""
    bad = []
    for peer in sorted(slices):
        try:
            check_int8(slices[peer][0], numel)
        except ValueError:
            bad.append(peer)
    good = [peer for peer in sorted(slices) if peer not in bad]
    if not good:
        raise IntegrityError("no slice decoded")
    total = math.fsum(float(slices[p][1]) for p in good)
    acc = torch.zeros(numel, dtype=torch.float32)
    for peer in good:
        data, samples = slices[peer]
        acc = acc + decode_int8(data, numel) * torch.tensor(float(samples) / total, dtype=torch.float32)
    out = encode_int8(acc)
    return out, hashlib.sha256(out).hexdigest(), bad


@dataclass
class OuterState:
    """θ_r, the outer optimizer and the round they belong to: what a checkpoint holds."""

    round: int
    weights: Named
    outer: OuterNesterov
    work: int = 0
    """Contributions applied in the history behind these weights (see protocol/round.py)."""
    hashes: tuple[str, str] | None = None
    """(weights hash, state hash) once computed or verified: the tensors never change in place."""

    def _hashes(self) -> tuple[str, str]:
        if self.hashes is None:
            self.hashes = (weights_hash(self.weights), weights_hash(self.state_tensors()))
        return self.hashes

    def weights_hash(self) -> str:
        return self._hashes()[0]

    def state_tensors(self) -> Named:
        return {**self.weights, **self.outer.state_dict()}

    def state_hash(self) -> str:
        return self._hashes()[1]


def new_state(spec: TaskSpec) -> OuterState:
    return OuterState(round=0, weights=initial_weights(spec),
                      outer=OuterNesterov(lr=spec.outer_lr, momentum=spec.outer_momentum))


def apply_aggregates(state: OuterState, payloads: list[bytes], work: int) -> OuterState:
    """θ_{r+1} from the chosen aggregate of every slice, through the deterministic outer Nesterov step."""
    flat, layout = flatten(state.weights)
    bounds = slice_bounds(flat.numel(), len(payloads))
    mean = torch.cat([decode_slice(p, b - a) for p, (a, b) in zip(payloads, bounds)])
    update = unflatten(mean, layout)
    outer = OuterNesterov(lr=state.outer.lr, momentum=state.outer.momentum)
    outer.buffers = dict(state.outer.buffers)  # step() replaces buffers, never mutates them: θ_r stays whole
    weights = outer.step(state.weights, update)
    return OuterState(round=state.round + 1, weights=weights, outer=outer, work=work)


def state_from_initial(spec: TaskSpec, tensors: Named) -> OuterState:
    """θ_0 from the spec's initial weights; IntegrityError unless they are exactly the model's float32 layout."""
    weights = {name: t.detach().clone() for name, t in sorted(tensors.items())}
    reference = initial_weights(spec)
    layout = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
    expected = {n: (tuple(t.shape), t.dtype) for n, t in reference.items()}
    if layout != expected:
        missing, extra = sorted(set(expected) - set(layout)), sorted(set(layout) - set(expected))
        wrong = sorted(n for n in set(layout) & set(expected) if layout[n] != expected[n])
        raise IntegrityError(f"initial weights do not match the task's model: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}, wrong shape or dtype {wrong[:3]}")
    if not all(bool(torch.isfinite(t).all()) for t in weights.values()):
        raise IntegrityError("initial weights hold NaN or infinite values")
    return OuterState(round=0, weights=weights, outer=OuterNesterov(lr=spec.outer_lr, momentum=spec.outer_momentum))


def state_from_tensors(spec: TaskSpec, r: int, tensors: Named, *, weights_hash_: str, state_hash: str,
                       work: int) -> OuterState:
    """Weights and momentum fetched from a peer, verified against the hashes the majority announced."""
    tensors = {name: t.clone() for name, t in tensors.items()}
    weights = {n: t for n, t in sorted(tensors.items()) if not n.startswith(MOMENTUM_PREFIX)}
    momentum = {n: t for n, t in tensors.items() if n.startswith(MOMENTUM_PREFIX)}
    reference = initial_weights(spec)
    if {n: tuple(t.shape) for n, t in weights.items()} != {n: tuple(t.shape) for n, t in reference.items()}:
        raise IntegrityError("fetched weights do not match the task's model layout")
    if weights_hash(weights) != weights_hash_ or weights_hash(dict(sorted(tensors.items()))) != state_hash:
        raise IntegrityError("fetched weights or optimizer state do not match the majority's hashes")
    outer = OuterNesterov(lr=spec.outer_lr, momentum=spec.outer_momentum)
    outer.load_state_dict(momentum)
    return OuterState(round=r, weights=weights, outer=outer, work=work, hashes=(weights_hash_, state_hash))


# -- checkpoints ---------------------------------------------------------------------------------

PARTS = ("weights", "momentum")
"""A checkpoint's tensor files, beside its meta.json: <part>.safetensors, and <part>.next.safetensors while saving."""


def save_checkpoint(directory: Path, state: OuterState) -> dict:
    """Both tensor files as .next, then meta.json (the commit point), then the .next files into place.

    Each write is atomic, but three files are not: a process killed between them would leave new
    weights beside old momentum and meta, which no longer verify. With meta.json last to commit and
    the .next files kept until then, load_checkpoint always finds the old or the new checkpoint whole.
    """
    directory.mkdir(parents=True, exist_ok=True)
    save_named(directory / "weights.next.safetensors", state.weights)
    save_named(directory / "momentum.next.safetensors", state.outer.state_dict())
    meta = {"round": state.round, "weights_hash": state.weights_hash(), "state_hash": state.state_hash(),
            "work": state.work}
    write_atomic(directory / "meta.json", json.dumps(meta).encode())
    for part in PARTS:
        os.replace(directory / f"{part}.next.safetensors", directory / f"{part}.safetensors")
    fsync_dir(directory)
    return meta


def load_checkpoint(directory: Path, spec: TaskSpec) -> OuterState | None:
    """The last complete checkpoint, or None if there is none or it does not verify.

    A save interrupted after its meta.json committed is finished here: the .next files that match
    the meta are moved into place, so the trainer reads the weights the meta names.
    """
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    choices = [[name for name in (f"{part}.safetensors", f"{part}.next.safetensors") if (directory / name).exists()]
               for part in PARTS]
    for weights_file in choices[0]:
        for momentum_file in choices[1]:
            try:
                weights = load_named(directory / weights_file)
                momentum = load_named(directory / momentum_file)
                outer = OuterNesterov(lr=spec.outer_lr, momentum=spec.outer_momentum)
                outer.load_state_dict(momentum)
            except (OSError, ValueError):
                continue
            state = OuterState(round=int(meta["round"]), weights=weights, outer=outer, work=int(meta.get("work", 0)))
            if state.weights_hash() != meta.get("weights_hash") or state.state_hash() != meta.get("state_hash"):
                continue
            for part, name in zip(PARTS, (weights_file, momentum_file)):
                if name != f"{part}.safetensors":
                    os.replace(directory / name, directory / f"{part}.safetensors")
            fsync_dir(directory)
            return state
    return None
