"""Tensors to one aligned byte blob and back, as (dtype, shape, bytes): no pickle, no numpy."""

from __future__ import annotations

import torch

from protocol.manifest import TensorEntry, layout_tensors

_TO_NAME = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8",
    torch.uint8: "uint8", torch.bool: "bool",
}
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}


def tensors_to_blob(tensors: dict[str, torch.Tensor]) -> tuple[bytearray, tuple[TensorEntry, ...]]:
    """Copy every tensor (on any device) into one blob; ValueError for a dtype the wire does not allow."""
    specs = []
    for name, t in tensors.items():
        if t.dtype not in _TO_NAME:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; shardcast carries {sorted(_FROM_NAME)}")
        specs.append((name, _TO_NAME[t.dtype], tuple(t.shape)))
    entries, total_bytes = layout_tensors(specs)
    blob = bytearray(total_bytes)
    for entry, t in zip(entries, tensors.values()):
        if entry.nbytes == 0:
            continue
        src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        dst = torch.frombuffer(blob, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
        dst.copy_(src)
    return blob, entries


def blob_to_tensors(blob: bytearray, entries: tuple[TensorEntry, ...]) -> dict[str, torch.Tensor]:
    """CPU tensors viewing ``blob`` (no copy): they share its memory and keep it alive."""
    out = {}
    for entry in entries:
        dtype = _FROM_NAME[entry.dtype]
        if entry.nbytes == 0:
            out[entry.name] = torch.empty(entry.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(blob, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=entry.offset)
        out[entry.name] = flat.reshape(entry.shape)
    return out
