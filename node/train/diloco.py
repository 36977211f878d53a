"""DiLoCo's outer side: named tensors, pseudo-gradients, weighted mean, outer Nesterov, hashing, files.

Every function here that feeds θ_{r+1} is elementwise float32 on CPU with operands in a fixed
order and scalars cast to float32 tensors first, and avoids fused multiply-add kernels
(alpha=, addcmul, lerp) whose rounding depends on the CPU: so every honest node that starts
from the same θ_r, state and aggregated update computes the same bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import pathlib

import torch
from safetensors.torch import load_file
from torch import nn

from node.fsutil import fsync_dir
from node.train.compress import tensor_bytes

Named = dict[str, torch.Tensor]


def named_tensors(source: nn.Module | Named) -> Named:
    """Parameters by name, sorted, as detached contiguous float32 CPU copies."""
    items = source.named_parameters() if isinstance(source, nn.Module) else source.items()
    return {name: _whole(t.detach()).to("cpu", torch.float32).contiguous().clone() for name, t in sorted(items)}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter sharded across local ranks (node/train/ranks.py) gathered whole: a collective every rank calls."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def flatten(named: Named) -> tuple[torch.Tensor, list[tuple[str, tuple[int, ...]]]]:
    """One flat float32 vector in sorted-name order, plus the layout to undo it."""
    layout = [(name, tuple(named[name].shape)) for name in sorted(named)]
    if not layout:
        return torch.zeros(0, dtype=torch.float32), layout
    return torch.cat([named[name].reshape(-1).to(torch.float32) for name, _ in layout]), layout


def unflatten(flat: torch.Tensor, layout: list[tuple[str, tuple[int, ...]]]) -> Named:
    total = sum(math.prod(shape) for _, shape in layout)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat vector of {flat.numel()} values does not fit a layout of {total}")
    out, start = {}, 0
    for name, shape in layout:
        n = math.prod(shape)
        out[name] = flat[start : start + n].view(shape).clone()
        start += n
    return out


def _check_same_layout(a: Named, b: Named, what: str) -> None:
    if a.keys() != b.keys():
        raise ValueError(f"{what}: names differ: {sorted(set(a) ^ set(b))}")
    for name in a:
        if a[name].shape != b[name].shape:
            raise ValueError(f"{what}: {name} has shape {tuple(a[name].shape)} vs {tuple(b[name].shape)}")


def pseudo_gradient(base: Named, trained: Named) -> Named:
    """Δ = θ_base − θ_trained per tensor: the direction the outer optimizer treats as a gradient."""
    _check_same_layout(base, trained, "pseudo_gradient")
    return {name: base[name].to(torch.float32) - trained[name].to(torch.float32) for name in sorted(base)}


def weighted_mean(updates: list[tuple[Named, float]]) -> Named:
    """Σ w_i·u_i / Σ w_i, summed in the order given: sort by peer id first (weighted_mean_by_peer)."""
    if not updates:
        raise ValueError("weighted_mean needs at least one update")
    if any(not math.isfinite(w) or w <= 0 for _, w in updates):
        raise ValueError(f"weights must be finite and > 0, got {[w for _, w in updates]}")
    first = updates[0][0]
    for named, _ in updates[1:]:
        _check_same_layout(first, named, "weighted_mean")
    total = math.fsum(w for _, w in updates)
    out = {}
    for name in sorted(first):
        acc = torch.zeros_like(first[name], dtype=torch.float32)
        for named, w in updates:
            acc = acc + named[name].to(torch.float32) * torch.tensor(w / total, dtype=torch.float32)
        out[name] = acc
    return out


def weighted_mean_by_peer(updates: dict[str, tuple[Named, float]]) -> Named:
    """weighted_mean in sorted peer-id order, so every aggregator sums in the same order."""
    return weighted_mean([updates[peer] for peer in sorted(updates)])


def fragments(sizes: list[tuple[str, int]], count: int) -> list[tuple[str, ...]]:
    """The model's tensors, (name, numel) in sorted-name order, cut into ``count`` contiguous fragments of about
    equal size (Streaming DiLoCo, task option ``fragments``): each tensor goes to the fragment its middle value
    falls in, every fragment gets at least one. ValueError when there are fewer tensors than fragments."""
    if count < 1 or count > len(sizes):
        raise ValueError(f"{count} fragments of a model of {len(sizes)} tensors: need 1..{len(sizes)}")
    total = sum(n for _, n in sizes)
    out: list[list[str]] = [[] for _ in range(count)]
    at, last = 0, 0
    for i, (name, n) in enumerate(sizes):
        wanted = min(count - 1, (2 * at + n) * count // max(1, 2 * total))
        # Never back, at most one fragment on per tensor, and the last tensors fill the fragments left.
        last = max(min(wanted, last + (1 if i else 0)), last, count - (len(sizes) - i))
        out[last].append(name)
        at += n
    return [tuple(f) for f in out]


def streaming_update(delta: Named, drift: Named, names) -> tuple[Named, Named]:
    """A round of Streaming DiLoCo from one member's side: ``delta`` is what it trained this round from θ_r − drift
    (base − trained), ``drift`` its unsynced progress per tensor (θ_r − local; absent: none). Returns (the update
    of the fragment ``names``: its whole progress since that fragment's last sync, drift + delta; the drift it
    carries into the next round: the same on every other tensor)."""
    total = {n: delta[n] + drift[n] if n in drift else delta[n] for n in delta}
    synced = set(names)
    return {n: total[n] for n in sorted(synced)}, {n: t for n, t in total.items() if n not in synced}


def local_weights(theta: Named, drift: Named) -> Named:
    """θ − drift per tensor: where a member's own model stands (Streaming DiLoCo), what its next round trains."""
    return {n: theta[n] - drift[n] if n in drift else theta[n] for n in theta}


class OuterNesterov:
    """SGD with Nesterov momentum on pseudo-gradients (torch.optim.SGD(nesterov=True) semantics).

    buf = momentum·buf + Δ;  θ = θ − lr·(Δ + momentum·buf). Buffers start at zero, which equals
    torch's first-step copy exactly. State is the buffers as named tensors ("momentum.<name>").
    """

    def __init__(self, *, lr: float = 0.7, momentum: float = 0.9):
        if not (lr > 0 and math.isfinite(lr)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got lr={lr}, momentum={momentum}")
        self.lr = lr
        self.momentum = momentum
        self.buffers: Named = {}

    def step(self, params: Named, update: Named) -> Named:
        """New parameters; params and update are left untouched."""
        _check_same_layout(params, update, "outer step")
        lr = torch.tensor(self.lr, dtype=torch.float32)
        mu = torch.tensor(self.momentum, dtype=torch.float32)
        out = {}
        for name in sorted(params):
            g = update[name].to(torch.float32)
            buf = self.buffers.get(name)
            buf = g.clone() if buf is None else buf * mu + g
            self.buffers[name] = buf
            out[name] = params[name].to(torch.float32) - (g + buf * mu) * lr
        return out

    def state_dict(self) -> Named:
        return {f"momentum.{name}": buf.clone() for name, buf in sorted(self.buffers.items())}

    def load_state_dict(self, state: Named) -> None:
        bad = [k for k in state if not k.startswith("momentum.")]
        if bad:
            raise ValueError(f"unexpected outer optimizer state keys: {bad[:5]}")
        self.buffers = {k.removeprefix("momentum."): t.to(torch.float32).clone() for k, t in state.items()}


def weights_hash(named: Named) -> str:
    """sha256 hex over (name, dtype, shape, raw bytes) of every tensor in sorted-name order."""
    h = hashlib.sha256(b"shoal/weights/v1")
    for name in sorted(named):
        t = named[name].detach().cpu().contiguous()
        header = json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode()
        h.update(len(header).to_bytes(4, "big") + header)
        if t.numel():
            h.update((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
    return h.hexdigest()


_ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL",
}


def save_named(path: str | os.PathLike, named: Named, metadata: dict[str, str] | None = None, *,
               durable: bool = True) -> None:
    """Write a safetensors file atomically: temp file, fsync, rename, fsync of the directory (``durable=False``:
    no fsyncs, for a caller that fsyncs the file itself later).

    The writer is these few lines because safetensors' own saver needs numpy, which Shoal does
    not depend on; reading goes through safetensors, which checks the layout.
    """
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, keep, offset = [], [], 0
    for name in sorted(named):
        t = named[name].detach().cpu().contiguous()
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code here")
        # A view of the tensor's memory, not a copy: it is written straight from there.
        raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()) if t.numel() else b""
        keep.append(t)
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for raw in blobs:
                f.write(raw)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def load_named(path: str | os.PathLike) -> Named:
    """Tensors of a safetensors file, by name in sorted order."""
    return dict(sorted(load_file(os.fspath(path)).items()))
