"""Block-wise int8 quantization of flat float32 updates, a raw byte layout for it, and error feedback.

Layout of encode_int8 for n values and block size b: ceil(n / b) float32 scales (little-endian,
one per block, absmax / 127), then n int8 values. Nothing else: the reader knows n and b from
the manifest, so a length that does not match is refused before anything is built from it.
"""

from __future__ import annotations

import ctypes
import sys

import torch

DEFAULT_BLOCK_SIZE = 256
_QMAX = 127.0

assert sys.byteorder == "little", "the int8 layout writes host-order float32 scales"


def num_blocks(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    return -(-numel // block_size)


def encoded_size(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of encode_int8 for numel values: 4 per block scale plus 1 per value."""
    return 4 * num_blocks(numel, block_size) + numel


def _check_flat(tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.float32 or tensor.dim() != 1:
        raise ValueError(f"expected a flat float32 tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}")


def quantize_int8(flat: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [n], float32 scales [ceil(n / block_size)]) with x ~= q * scale per block."""
    _check_flat(flat)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not torch.isfinite(flat).all():
        raise ValueError("cannot quantize non-finite values (nan or inf in the update)")
    n = flat.numel()
    padded = torch.zeros(num_blocks(n, block_size) * block_size, dtype=torch.float32)
    padded[:n] = flat
    blocks = padded.view(-1, block_size)
    scales = blocks.abs().amax(dim=1) / _QMAX
    # An all-zero block keeps scale 0; divide by 1 there so it quantizes to zeros, not nan.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q.view(-1)[:n].clone(), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """float32 [n] = q * scale of its block; elementwise, so every node gets the same bits."""
    n = q.numel()
    if q.dtype != torch.int8 or scales.dtype != torch.float32 or scales.numel() != num_blocks(n, block_size):
        raise ValueError(f"{n} int8 values need {num_blocks(n, block_size)} float32 scales, got {scales.numel()}")
    padded = torch.zeros(scales.numel() * block_size, dtype=torch.float32)
    padded[:n] = q.to(torch.float32)
    return (padded.view(-1, block_size) * scales[:, None]).view(-1)[:n].clone()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous CPU tensor, without numpy."""
    t = tensor.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def encode_int8(flat: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> bytes:
    q, scales = quantize_int8(flat, block_size)
    return tensor_bytes(scales) + tensor_bytes(q)


def check_int8(data: bytes, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """ValueError unless decode_int8 would accept ``data``; reads only the scales (1/64 of the bytes)."""
    expected = encoded_size(numel, block_size)
    if len(data) != expected:
        raise ValueError(f"int8 payload for {numel} values is {expected} bytes, got {len(data)}")
    split = 4 * num_blocks(numel, block_size)
    if split:
        scales = torch.frombuffer(bytearray(data[:split]), dtype=torch.float32)
        if not (torch.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError("int8 payload has a negative or non-finite block scale")


def decode_int8(data: bytes, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Inverse of encode_int8; a wrong length or a negative or non-finite scale is a ValueError."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    expected = encoded_size(numel, block_size)
    if len(data) != expected:
        raise ValueError(f"int8 payload for {numel} values is {expected} bytes, got {len(data)}")
    if numel == 0:
        return torch.zeros(0, dtype=torch.float32)
    buf = bytearray(data)
    split = 4 * num_blocks(numel, block_size)
    scales = torch.frombuffer(buf, dtype=torch.float32, count=split // 4)
    q = torch.frombuffer(buf, dtype=torch.int8, offset=split)
    if not (torch.isfinite(scales).all() and (scales >= 0).all()):
        raise ValueError("int8 payload has a negative or non-finite block scale")
    return dequantize_int8(q, scales, block_size)


class ErrorFeedback:
    """Per-parameter residuals: what quantization dropped this round is added back next round."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = block_size
        self.residuals: dict[str, torch.Tensor] = {}

    def encode(self, name: str, flat: torch.Tensor) -> bytes:
        """encode_int8(flat + residual), keeping the new residual for this name."""
        _check_flat(flat)
        corrected = flat + self.residuals[name] if name in self.residuals else flat
        data = encode_int8(corrected, self.block_size)
        self.residuals[name] = corrected - decode_int8(data, corrected.numel(), self.block_size)
        return data

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {name: t.to(torch.float32).clone() for name, t in state.items()}
