"""Block-wise quantization of flat float32 updates to 8, 4 or 2 bits, a raw byte layout for it, and error feedback.

Layout for n values, block size b and w bits: ceil(n / b) float32 scales (little-endian, one per
block, absmax / qmax with qmax = 2^(w-1) - 1: 127, 7 or 1), then the n values. At 8 bits each value
is one int8; at 4 and 2 bits each is stored as q + qmax (0 .. 2 qmax) in w bits, 8 / w to a byte,
the first value in the lowest bits, the last byte padded with zeros. Nothing else: the reader knows
n, b and w from the task, so a length that does not match is refused before anything is built
from it. Decoding is elementwise (q times its block's scale), so every node gets the same bits.
"""

from __future__ import annotations

import ctypes
import sys

import torch

DEFAULT_BLOCK_SIZE = 256
_QMAX = 127.0
BITS = {"int8": 8, "int4": 4, "int2": 2}
"""Bits per value of each compression a task may name."""

assert sys.byteorder == "little", "the layout writes host-order float32 scales"


def qmax(bits: int) -> float:
    return float(2 ** (bits - 1) - 1)


def _check_bits(bits: int) -> None:
    if bits not in (8, 4, 2):
        raise ValueError(f"bits must be 8, 4 or 2, got {bits}")


def num_blocks(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    return -(-numel // block_size)


def encoded_size(numel: int, block_size: int = DEFAULT_BLOCK_SIZE, bits: int = 8) -> int:
    """Bytes of the layout for numel values: 4 per block scale plus bits / 8 per value (rounded up)."""
    return 4 * num_blocks(numel, block_size) + -(-numel * bits // 8)


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


def encode_int8(flat: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> bytearray:
    """The layout above at 8 bits, built chunk by chunk into one buffer: quantize_int8's bits without its
    full-size temporaries."""
    return encode_blocks(flat, block_size, bits=8)


def encode_blocks(flat: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *, bits: int = 8) -> bytearray:
    """The layout above at ``bits`` bits, chunk by chunk."""
    _check_flat(flat)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    writer = QuantWriter(flat.numel(), block_size, bits=bits)
    flat = flat.contiguous()
    step = CHUNK_BLOCKS * block_size
    for lo in range(0, flat.numel(), step):
        writer.write(lo, flat[lo:lo + step])
    return writer.out


CHUNK_BLOCKS = 4096
"""Blocks per chunk of the streaming coders: 1M values at the default block size, a few MB of temporaries."""


def _quantize_blocks(blocks: torch.Tensor, scales_out: torch.Tensor, limit: float = _QMAX) -> torch.Tensor:
    """quantize_int8 on whole blocks (at ``limit`` = qmax), the scales written into the caller's view: the same
    operations, so the same bits. Returns q, whole numbers within +-limit, as float32 (a fresh tensor)."""
    # max |x| per block as max(amax, -amin): exact, and without a whole copy for abs(). A nan or inf anywhere
    # in a block makes its maximum non-finite, so the finiteness check needs only the block maxima.
    peak = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_()  # abs_: -0.0 of a zero block
    if not torch.isfinite(peak).all():
        raise ValueError("cannot quantize non-finite values (nan or inf in the update)")
    scales = peak.div_(limit)
    scales_out.copy_(scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.div(blocks, safe[:, None]).round_().clamp_(-limit, limit)


def _pack(u: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values below 2^bits, 8 / bits to a byte, the first in the lowest bits."""
    per = 8 // bits
    lanes = u.view(-1, per)
    out = lanes[:, 0].clone()
    for j in range(1, per):
        out |= lanes[:, j] << (bits * j)
    return out


def _unpack(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """The uint8 values _pack packed: 8 / bits per byte."""
    out = torch.empty(raw.numel() * (8 // bits), dtype=torch.uint8)
    _unpack_into(raw, bits, out)
    return out


def _unpack_into(raw: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """_unpack into ``out`` (8 / bits values per byte of ``raw``, any dtype that holds them): lane by lane into
    strided views, one pass per lane with no temporary wider than a byte."""
    per, ones = 8 // bits, 2 ** bits - 1
    lanes = out.view(-1, per)
    for j in range(per):
        lane = raw >> (bits * j) if j else raw
        lanes[:, j].copy_(lane if j == per - 1 else lane & ones)  # the top lane has nothing above it


class QuantWriter:
    """Builds one payload of the layout above from consecutive block-aligned runs of values."""

    def __init__(self, numel: int, block_size: int = DEFAULT_BLOCK_SIZE, *, bits: int = 8):
        _check_bits(bits)
        if bits < 8 and block_size % (8 // bits):
            raise ValueError(f"block_size must be a multiple of {8 // bits} at {bits} bits, got {block_size}")
        self.numel, self.block_size, self.bits = numel, block_size, bits
        self.limit = qmax(bits)
        self.out = bytearray(encoded_size(numel, block_size, bits))
        split = 4 * num_blocks(numel, block_size)
        self._scales = torch.frombuffer(self.out, dtype=torch.float32, count=split // 4) if split else None
        self._q = torch.frombuffer(self.out, dtype=torch.int8, offset=split) if numel and bits == 8 else None
        self._packed = torch.frombuffer(self.out, dtype=torch.uint8, offset=split) if numel and bits < 8 else None

    def write(self, lo: int, values: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        """Values ``lo .. lo + len(values)``; ``lo`` starts a block, and only the last run may end mid-block.
        ``residual`` (as long as ``values``, and may be ``values`` itself): receives values minus what a reader
        decodes of them, the same bits as decoding the payload, without a second pass over it (error feedback)."""
        bs, n = self.block_size, values.numel()
        assert lo % bs == 0 and lo + n <= self.numel and (n % bs == 0 or lo + n == self.numel)
        assert residual is None or residual.numel() == n
        if n == 0:
            return
        b0, full = lo // bs, n // bs
        if full:
            blocks = values[:full * bs].view(full, bs)
            scales = self._scales[b0:b0 + full]
            q = _quantize_blocks(blocks, scales, self.limit)
            if self._q is not None:
                self._q[lo:lo + full * bs].view(full, bs).copy_(q)
                # As QuantPayload.decode reads it: an int8 made float (a -0.0 of q decodes as 0.0).
                sent = self._q[lo:lo + full * bs].view(full, bs).to(torch.float32) if residual is not None else None
            else:
                self._put(lo, q.view(-1).add_(self.limit).to(torch.uint8))  # stored offset by qmax, 0 .. 2 qmax
                sent = q.sub_(self.limit) if residual is not None else None  # as decode does: u - qmax, exact
            if sent is not None:
                torch.sub(blocks, sent.mul_(scales[:, None]), out=residual[:full * bs].view(full, bs))
        rest = n - full * bs
        if rest:
            padded = torch.zeros(1, bs, dtype=torch.float32)
            padded[0, :rest] = values[full * bs:]
            scale = self._scales[b0 + full:b0 + full + 1]
            q = _quantize_blocks(padded, scale, self.limit).view(-1)
            at = lo + full * bs
            if self._q is not None:
                self._q[at:].copy_(q[:rest])
                sent = self._q[at:].to(torch.float32)
            else:
                u = torch.zeros(bs, dtype=torch.uint8)  # the padding past the last value stays zero bits
                u[:rest] = q[:rest].add_(self.limit).to(torch.uint8)
                self._put(at, u, count=rest)
                sent = q[:rest].sub_(self.limit)
            if residual is not None:
                torch.sub(values[full * bs:], sent.mul_(scale), out=residual[full * bs:])

    def _put(self, lo: int, u: torch.Tensor, count: int | None = None) -> None:
        packed = _pack(u, self.bits)
        start = lo * self.bits // 8
        length = packed.numel() if count is None else -(-count * self.bits // 8)
        self._packed[start:start + length].copy_(packed[:length])


class QuantPayload:
    """One payload of the layout above viewed in place (bytes-like or a uint8 tensor, never copied unless
    read-only), checked once, decoded range by range into the caller's scratch buffer."""

    def __init__(self, data, numel: int, block_size: int = DEFAULT_BLOCK_SIZE, *, bits: int = 8):
        _check_bits(bits)
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        expected = encoded_size(numel, block_size, bits)
        if len(data) != expected:
            raise ValueError(f"{bits}-bit payload for {numel} values is {expected} bytes, got {len(data)}")
        self.numel, self.block_size, self.bits = numel, block_size, bits
        self.limit = qmax(bits)
        raw = byte_view(data)
        split = 4 * num_blocks(numel, block_size)
        # The scales sit at the payload's start, so an aligned buffer gives an aligned float32 view.
        self.scales = raw[:split].view(torch.float32) if split else torch.zeros(0)
        self.q = raw[split:].view(torch.int8) if bits == 8 else None
        self.packed = raw[split:] if bits < 8 else None
        if split and not (torch.isfinite(self.scales).all() and (self.scales >= 0).all()):
            raise ValueError(f"{bits}-bit payload has a negative or non-finite block scale")
        # The encoder writes |q| <= qmax; one step past it (-128, or a 4-bit 15 / 2-bit 3 that would
        # decode as 8 or 2 times the block's scale) comes from no honest node.
        # (Reductions, not comparisons: a min or max is one pass with no whole-payload temporary.)
        if self.q is not None and self.q.numel() and int(self.q.min()) == -128:
            raise ValueError("8-bit payload holds -128, past the encoder's range of +-127")
        if self.packed is not None and self.packed.numel() and _has_all_ones_lane(self.packed, bits):
            raise ValueError(f"{bits}-bit payload holds a value past the encoder's range of +-{self.limit:g}")

    def scratch(self, numel: int) -> torch.Tensor:
        """A buffer big enough for decode of any ``numel`` values (whole covering blocks)."""
        return torch.empty((numel // self.block_size + 2) * self.block_size, dtype=torch.float32)

    def decode(self, lo: int, hi: int, scratch: torch.Tensor) -> torch.Tensor:
        """float32 values lo .. hi (q times its block's scale), in a view of ``scratch``."""
        bs = self.block_size
        b0, b1 = lo // bs, -(-hi // bs)
        span = scratch[:(b1 - b0) * bs]
        have = min(self.numel, b1 * bs) - b0 * bs
        if self.q is not None:
            span[:have].copy_(self.q[b0 * bs:b0 * bs + have])
        else:
            per = 8 // self.bits
            first, last = b0 * bs // per, -(-(b0 * bs + have) // per)
            # Whole bytes' values (past ``have`` by less than a byte, still inside the span's blocks); those past
            # ``have`` are zeroed below.
            _unpack_into(self.packed[first:last], self.bits, span[:(last - first) * per])
            span[:have].sub_(self.limit)
        span[have:].zero_()
        span.view(-1, bs).mul_(self.scales[b0:b1, None])
        return span[lo - b0 * bs:hi - b0 * bs]


def _has_all_ones_lane(packed: torch.Tensor, bits: int) -> bool:
    """Whether any ``bits``-wide lane of the packed bytes is all ones (2 * qmax + 1, past the encoder's range):
    tested on the packed bytes in place of unpacking the whole payload a second time. The top lane is all
    ones exactly when the byte is at least its mask; each lower lane, when the byte masked to it is."""
    ones = 2 ** bits - 1
    top = ones << (8 - bits)
    if int(packed.max()) >= top:
        return True
    return any(int((packed & (ones << shift)).max()) == ones << shift for shift in range(0, 8 - bits, bits))


def byte_view(data) -> torch.Tensor:
    """A payload as a flat uint8 tensor: a tensor as it is, bytes-like without a copy unless read-only."""
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    if not len(data):
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)


def check_int8(data, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """ValueError unless decode_int8 would accept ``data``: its length, scales and values."""
    QuantPayload(data, numel, block_size)


def decode_int8(data, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Inverse of encode_int8; a wrong length or a negative or non-finite scale is a ValueError."""
    return decode_blocks(data, numel, block_size, bits=8)


def decode_blocks(data, numel: int, block_size: int = DEFAULT_BLOCK_SIZE, *, bits: int = 8) -> torch.Tensor:
    """Inverse of encode_blocks at ``bits``; a wrong length or a negative or non-finite scale is a ValueError."""
    payload = QuantPayload(data, numel, block_size, bits=bits)
    if numel == 0:
        return torch.zeros(0, dtype=torch.float32)
    return payload.decode(0, numel, payload.scratch(numel))


class ErrorFeedback:
    """Per-parameter residuals: what quantization dropped this round is added back next round.

    Block-wise at ``bits``, or through ``codec`` (anything with ``encode(flat)`` and ``decode(data, numel)``,
    as node/train/codecs.py's)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, *, bits: int = 8, codec=None):
        _check_bits(bits)
        self.block_size, self.bits, self.codec = block_size, bits, codec
        self.residuals: dict[str, torch.Tensor] = {}

    def encode(self, name: str, flat: torch.Tensor) -> bytearray:
        """The payload of flat + residual, keeping the new residual for this name."""
        _check_flat(flat)
        corrected = flat + self.residuals[name] if name in self.residuals else flat
        if self.codec is not None:
            data = self.codec.encode(corrected)
            sent = self.codec.decode(data, corrected.numel())
        else:
            data = encode_blocks(corrected, self.block_size, bits=self.bits)
            sent = decode_blocks(data, corrected.numel(), self.block_size, bits=self.bits)
        self.residuals[name] = corrected - sent
        return data

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {name: t.to(torch.float32).clone() for name, t in state.items()}
