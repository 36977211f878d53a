"""The tensor side of a round, run in threads: slices, payloads, aggregation, the outer step, the state's hashes
(what a task keeps on disk is task_files.py)."""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from node.train.codecs import INT8, Codec
from node.train.compress import CHUNK_BLOCKS, DEFAULT_BLOCK_SIZE, tensor_bytes
from node.train.diloco import Named, OuterNesterov, named_tensors, weights_hash
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


def payload_tensor(data: bytes | bytearray) -> dict[str, torch.Tensor]:
    buf = data if isinstance(data, bytearray) else bytearray(data)
    return {PAYLOAD: torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.zeros(0, dtype=torch.uint8)}


def split_update(delta: Named, num_slices: int, codec: Codec = INT8) -> list[bytearray]:
    """Δ flattened in sorted-name order, cut into slices, each encoded by ``codec`` (chunk by chunk, no flat copy)."""
    names = sorted(delta)
    sizes = [delta[n].numel() for n in names]
    bounds = slice_bounds(sum(sizes), num_slices)
    writers = [codec.writer(b - a) for a, b in bounds]
    pending = [torch.zeros(0)] * num_slices  # values waiting for a block boundary, per slice
    at = 0
    for name, n in zip(names, sizes):
        flat = delta[name].detach().reshape(-1).to(torch.float32).contiguous()
        for s, (a, b) in enumerate(bounds):
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                pending[s] = _feed(writers[s], lo - a, flat[lo - at:hi - at], pending[s], b - a)
        at += n
    return [w.out for w in writers]


def split_with_feedback(delta: Named, num_slices: int, codec: Codec,
                        residual: Named | None) -> tuple[list[bytearray], Named]:
    """split_update of Δ plus what quantization dropped from the previous update (error feedback), and what it
    drops from this one: the residual to add to the next. A residual whose names or shapes do not match Δ's
    (another model) is ignored."""
    if residual is not None and {n: t.shape for n, t in residual.items()} != {n: t.shape for n, t in delta.items()}:
        residual = None
    names = sorted(delta)
    sizes = [delta[n].numel() for n in names]
    # One flat buffer, Δ + residual in sorted-name order: encoded slice by slice, and each run of it overwritten
    # in place by what its encoding dropped, which is the next residual (views of it, by name).
    flat, at = torch.empty(sum(sizes), dtype=torch.float32), 0
    for name, n in zip(names, sizes):
        d = delta[name].detach().reshape(-1)
        if residual is not None:
            torch.add(d.to(torch.float32), residual[name].reshape(-1).to(torch.float32), out=flat[at:at + n])
        else:
            flat[at:at + n].copy_(d)
        at += n
    payloads = []
    step = CHUNK_BLOCKS * codec.block_size
    dense = not codec.keep  # a dense block writer works out what it drops as it writes (QuantWriter.write)
    for a, b in slice_bounds(flat.numel(), num_slices):
        writer = codec.writer(b - a)
        for lo in range(0, b - a, step):
            run = flat[a + lo:min(b, a + lo + step)]
            writer.write(lo, run, **({"residual": run} if dense else {}))
        if not dense:
            # Top-k's writer does not say what it dropped: the slice decoded, as a reader would.
            flat[a:b].sub_(codec.decode(writer.out, b - a))
        payloads.append(writer.out)
    out, at = {}, 0
    for name, n in zip(names, sizes):
        out[name] = flat[at:at + n].view(delta[name].shape)
        at += n
    return payloads, out


def fragment_with_feedback(delta: Named, num_slices: int, codec: Codec,
                           residual: Named | None) -> tuple[list[bytearray], Named]:
    """split_with_feedback of an update that may cover only some of the model's tensors (a fragment: task option
    ``fragments``), with the residual kept for all of them: the fragment's part of it (zero for a tensor not sent
    before) goes into this update, and the residual returned is the whole one with that part replaced."""
    if residual is None or set(residual) == set(delta):
        return split_with_feedback(delta, num_slices, codec, residual)
    part = {n: residual[n] if n in residual and residual[n].shape == delta[n].shape
            else torch.zeros(delta[n].shape, dtype=torch.float32) for n in delta}
    payloads, kept = split_with_feedback(delta, num_slices, codec, part)
    return payloads, {**residual, **kept}


def _feed(writer, lo: int, values: torch.Tensor, pending: torch.Tensor, numel: int) -> torch.Tensor:
    """Write values starting at slice offset ``lo`` (after ``pending``) in whole blocks; return what is left over."""
    if pending.numel():
        values = torch.cat([pending, values])
        lo -= pending.numel()
    bs = writer.block_size
    end = lo + values.numel()
    cut = values.numel() if end == numel else values.numel() - (end % bs)
    if cut:
        writer.write(lo, values[:cut])
    return values[cut:].clone() if cut < values.numel() else torch.zeros(0)


def payload_bytes(manifest: Manifest, tensors: dict[str, torch.Tensor], numel: int, codec: Codec = INT8) -> bytes:
    """The payload of a slice manifest as bytes (see payload_view)."""
    return tensor_bytes(payload_view(manifest, tensors, numel, codec))


def payload_view(manifest: Manifest, tensors: dict[str, torch.Tensor], numel: int,
                 codec: Codec = INT8) -> torch.Tensor:
    """The payload (encoded by ``codec``) of a slice manifest as a uint8 view, no copy; IntegrityError unless it is
    exactly one tensor of the right size."""
    expected = codec.size(numel)
    entries = manifest.tensors
    if len(entries) != 1 or entries[0].name != PAYLOAD or entries[0].dtype != "uint8" \
            or entries[0].shape != (expected,):
        shapes = [(e.name, e.dtype, e.shape) for e in entries]
        raise IntegrityError(f"slice payload must be one uint8 tensor {PAYLOAD!r} of {expected} bytes, got {shapes}")
    return tensors[PAYLOAD]


def decode_slice(data, numel: int, codec: Codec = INT8) -> torch.Tensor:
    try:
        return codec.decode(data, numel)
    except ValueError as exc:
        raise IntegrityError(f"bad {codec.name} slice: {exc}") from None


def _open_slice(data, numel: int, codec: Codec = INT8):
    try:
        return codec.open(data, numel)
    except ValueError as exc:
        raise IntegrityError(f"bad {codec.name} aggregate: {exc}") from None


def aggregate(slices: dict[str, tuple[bytes, int]], numel: int, codec: Codec = INT8,
              out: Codec = INT8) -> tuple[bytearray, str, list[str]]:
    """aggregate_payload, and the sha256 of the result."""
    data, bad = aggregate_payload(slices, numel, codec, out)
    return data, hashlib.sha256(data).hexdigest(), bad


def open_slices(slices: dict, numel: int, codec: Codec = INT8) -> tuple[dict, list[str]]:
    """Each producer's slice (encoded by ``codec``) opened in sorted producer order, and the producers whose slice
    does not decode."""
    views, bad = {}, []
    for peer in sorted(slices):
        try:
            views[peer] = codec.open(slices[peer][0], numel)
        except ValueError:
            bad.append(peer)
    return views, bad


def aggregate_payload(slices: dict, numel: int, codec: Codec = INT8, out: Codec = INT8) -> tuple[bytearray, list[str]]:
    """Weighted mean (by samples, sorted producer order) of the producers' slices (encoded by ``codec``), encoded
    by ``out``, and the producers whose slice did not decode (left out). Streams: chunk by chunk, each
    producer's bytes decoded into one scratch buffer and added in, with the same operations in the same order
    as diloco.weighted_mean (zeros, then acc + decoded * w per producer), so every aggregator computes the same
    bits; nothing whole-slice in fp32."""
    views, bad = open_slices(slices, numel, codec)
    if not views:
        raise IntegrityError("no slice decoded")
    total = math.fsum(float(slices[p][1]) for p in views)
    weights = {p: torch.tensor(float(slices[p][1]) / total, dtype=torch.float32) for p in views}
    writer = out.writer(numel)
    step = CHUNK_BLOCKS * writer.block_size
    acc = torch.empty(min(step, numel), dtype=torch.float32)
    scratch = torch.empty((CHUNK_BLOCKS + 2) * writer.block_size, dtype=torch.float32)
    for lo in range(0, numel, step):
        hi = min(numel, lo + step)
        chunk = acc[:hi - lo].zero_()
        for peer, view in views.items():
            chunk.add_(view.decode(lo, hi, scratch).mul_(weights[peer]))
        writer.write(lo, chunk)
    return writer.out, bad


def momentum_named(outer: OuterNesterov) -> Named:
    """The outer state as named tensors, without state_dict's copies: nothing here is changed in place."""
    return {f"{MOMENTUM_PREFIX}{name}": buf for name, buf in sorted(outer.buffers.items())}


def state_hash_of(weights_hash_: str, momentum_hash: str) -> str:
    """The state hash: the weights' hash (known already) with the momentum's, so the weights are hashed once."""
    return hashlib.sha256(f"shoal/state/v2:{weights_hash_}:{momentum_hash}".encode()).hexdigest()


def _in_threads(*calls):
    """Run independent whole-model hashes side by side: sha256 releases the GIL on large buffers."""
    if len(calls) == 1:
        return [calls[0]()]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


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
            momentum = momentum_named(self.outer)
            weights_h, momentum_h = _in_threads(lambda: weights_hash(self.weights), lambda: weights_hash(momentum))
            self.hashes = (weights_h, state_hash_of(weights_h, momentum_h))
        return self.hashes

    def weights_hash(self) -> str:
        return self._hashes()[0]

    def state_tensors(self) -> Named:
        return {**self.weights, **momentum_named(self.outer)}

    def state_hash(self) -> str:
        return self._hashes()[1]


def new_state(spec: TaskSpec) -> OuterState:
    return OuterState(round=0, weights=initial_weights(spec),
                      outer=OuterNesterov(lr=spec.outer_lr, momentum=spec.outer_momentum))


def apply_aggregates(state: OuterState, payloads: list, work: int, codec: Codec = INT8,
                     names: tuple[str, ...] | None = None) -> OuterState:
    """θ_{r+1} from the chosen aggregate of every slice, through the outer Nesterov step of OuterNesterov.step,
    chunk by chunk: each aggregate decoded straight into the step, new tensors written once, θ_r left whole.
    ``names``: the tensors the round syncs (a fragment, task option ``fragments``), in sorted order, which the
    slices cover; every other tensor and its momentum is kept as it is (the same tensors). None: all.

    Per element, the same float32 operations in the same order as OuterNesterov.step (buf = buf·μ + g, or g on
    the first step; θ − (g + buf·μ)·lr), so every node reaches the same bits."""
    if names is not None:
        part = OuterState(round=state.round, weights={n: state.weights[n] for n in names},
                          outer=OuterNesterov(lr=state.outer.lr, momentum=state.outer.momentum), work=state.work)
        part.outer.buffers = {n: state.outer.buffers[n] for n in names if n in state.outer.buffers}
        new = apply_aggregates(part, payloads, work, codec)
        outer = OuterNesterov(lr=state.outer.lr, momentum=state.outer.momentum)
        outer.buffers = {**state.outer.buffers, **new.outer.buffers}
        return OuterState(round=new.round, weights={**state.weights, **new.weights}, outer=outer, work=work)
    names = sorted(state.weights)
    numel = sum(state.weights[n].numel() for n in names)
    bounds = slice_bounds(numel, len(payloads))
    views = [_open_slice(p, b - a, codec) for p, (a, b) in zip(payloads, bounds)]
    lr = torch.tensor(state.outer.lr, dtype=torch.float32)
    mu = torch.tensor(state.outer.momentum, dtype=torch.float32)
    step = CHUNK_BLOCKS * DEFAULT_BLOCK_SIZE
    scratch = torch.empty((CHUNK_BLOCKS + 2) * DEFAULT_BLOCK_SIZE, dtype=torch.float32)
    gathered = torch.empty(step, dtype=torch.float32)
    tmp = torch.empty(step, dtype=torch.float32)

    def update(lo: int, hi: int) -> torch.Tensor:
        """The mean update for flat positions lo .. hi (at most one chunk), decoded from the slices it spans."""
        parts = [(s, max(a, lo), min(b, hi)) for s, (a, b) in enumerate(bounds) if max(a, lo) < min(b, hi)]
        if len(parts) == 1:
            s, x, y = parts[0]
            return views[s].decode(x - bounds[s][0], y - bounds[s][0], scratch)
        out = gathered[:hi - lo]
        for s, x, y in parts:
            out[x - lo:y - lo].copy_(views[s].decode(x - bounds[s][0], y - bounds[s][0], scratch))
        return out

    weights, buffers, at = {}, {}, 0
    for name in names:
        theta = state.weights[name].detach().reshape(-1).to(torch.float32)
        old = state.outer.buffers.get(name)
        old = old.reshape(-1) if old is not None else None
        new_theta = torch.empty(theta.numel(), dtype=torch.float32)
        new_buf = torch.empty(theta.numel(), dtype=torch.float32)
        for lo in range(0, theta.numel(), step):
            hi = min(theta.numel(), lo + step)
            g = update(at + lo, at + hi)
            buf = new_buf[lo:hi]
            if old is None:
                buf.copy_(g)
            else:
                torch.mul(old[lo:hi], mu, out=buf)
                buf.add_(g)
            t = tmp[:hi - lo]
            torch.mul(buf, mu, out=t)
            t.add_(g)  # g + buf·μ: float addition commutes bit for bit
            t.mul_(lr)
            torch.sub(theta[lo:hi], t, out=new_theta[lo:hi])
        shape = state.weights[name].shape
        weights[name], buffers[name] = new_theta.view(shape), new_buf.view(shape)
        at += theta.numel()
    outer = OuterNesterov(lr=state.outer.lr, momentum=state.outer.momentum)
    outer.buffers = buffers
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
    """Weights and momentum fetched from a peer, verified against the hashes the majority announced. The tensors
    are kept as they are (views of the fetched buffer): nothing changes them in place."""
    weights = {n: t for n, t in sorted(tensors.items()) if not n.startswith(MOMENTUM_PREFIX)}
    momentum = {n: t for n, t in sorted(tensors.items()) if n.startswith(MOMENTUM_PREFIX)}
    reference = initial_weights(spec)
    if {n: tuple(t.shape) for n, t in weights.items()} != {n: tuple(t.shape) for n, t in reference.items()}:
        raise IntegrityError("fetched weights do not match the task's model layout")
    outer = OuterNesterov(lr=spec.outer_lr, momentum=spec.outer_momentum)
    outer.buffers = {n.removeprefix(MOMENTUM_PREFIX): t.to(torch.float32) for n, t in momentum.items()}
    state = OuterState(round=r, weights=weights, outer=outer, work=work)
    if state.weights_hash() != weights_hash_ or state.state_hash() != state_hash:
        raise IntegrityError("fetched weights or optimizer state do not match the majority's hashes")
    return state
