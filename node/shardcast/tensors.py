"""Tensors to one aligned byte blob and back, as (dtype, shape, bytes): no pickle, no numpy."""

from __future__ import annotations

import ctypes

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


class TensorParts:
    """The blob tensors_to_blob would build, without building it: byte views of the tensors' own memory at their
    offsets (the alignment gaps are zeros), read shard by shard. The tensors must stay unchanged meanwhile."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        specs = []
        for name, t in tensors.items():
            if t.dtype not in _TO_NAME:
                raise ValueError(f"tensor {name!r} has dtype {t.dtype}; shardcast carries {sorted(_FROM_NAME)}")
            specs.append((name, _TO_NAME[t.dtype], tuple(t.shape)))
        self.entries, self.total_bytes = layout_tensors(specs)
        self._keep, self._parts = [], []
        for entry, t in zip(self.entries, tensors.values()):
            if entry.nbytes:
                src = t.detach().to("cpu").contiguous()  # no copy for a contiguous CPU tensor
                self._keep.append(src)
                raw = (ctypes.c_char * entry.nbytes).from_address(src.data_ptr())
                self._parts.append((entry.offset, memoryview(raw).cast("B")))

    def pieces(self, start: int, end: int) -> list[memoryview | bytes]:
        """The blob's bytes start .. end as consecutive pieces: views of tensor memory and zero gaps."""
        out, at = [], start
        for offset, view in self._parts:
            lo, hi = max(at, offset), min(end, offset + len(view))
            if lo >= hi:
                continue
            if lo > at:
                out.append(bytes(lo - at))
            out.append(view[lo - offset:hi - offset])
            at = hi
        if at < end:
            out.append(bytes(end - at))
        return out
