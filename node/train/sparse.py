"""Chunked top-k of flat float32 updates with low-bit values (SparseLoCo-style), and its raw byte layout.

The values are cut into chunks of CHUNK (4096); a chunk of L values keeps its k = ceil(L * keep / CHUNK)
largest in magnitude, quantized to ``bits`` against the chunk's kept absmax like compress.py's blocks
(q + qmax in ``bits`` bits). Layout for n values: one float32 scale per chunk (little-endian), then every
kept value's offset inside its chunk as 12 bits (two to three bytes, the first in the low bits; an odd
count padded with a zero offset), chunk after chunk and ascending within a chunk, then the kept values
``8 / bits`` to a byte in the same order. The size depends only on n, keep and bits, so a length that
does not match is refused before anything is built. Decoding scatters q times its chunk's scale into
zeros, elementwise, so every node gets the same bits; offsets that are not strictly ascending inside a
chunk, or that fall past it, come from no honest encoder and are refused, as are the values one step
past the range.

Error feedback (compute.split_with_feedback) carries what the top-k and the quantization drop into the
producer's next update, which is what makes so few values enough.
"""

from __future__ import annotations

import torch

from node.train.compress import DEFAULT_BLOCK_SIZE, _pack, _unpack, byte_view, qmax

CHUNK = 4096
INDEX_BITS = 12
assert CHUNK == 1 << INDEX_BITS


def num_chunks(numel: int) -> int:
    return -(-numel // CHUNK)


def kept_in(length: int, keep: int) -> int:
    """Values kept from a chunk of ``length``: the same share as a whole chunk's ``keep``, at least one."""
    return min(length, max(1, -(-length * keep // CHUNK))) if length else 0


def kept_total(numel: int, keep: int) -> int:
    full, rest = divmod(numel, CHUNK)
    return full * kept_in(CHUNK, keep) + kept_in(rest, keep)


def _check(keep: int, bits: int) -> None:
    if not 1 <= keep <= CHUNK:
        raise ValueError(f"keep must be in 1 .. {CHUNK}, got {keep}")
    if bits not in (4, 2):
        raise ValueError(f"top-k values take 4 or 2 bits, got {bits}")


def index_bytes(total: int) -> int:
    """12-bit offsets go in pairs of three bytes; an odd count is padded with a zero offset."""
    return 3 * -(-total // 2)


def encoded_size(numel: int, keep: int, bits: int) -> int:
    t = kept_total(numel, keep)
    return 4 * num_chunks(numel) + index_bytes(t) + -(-t * bits // 8)


def _pack12(idx: torch.Tensor) -> torch.Tensor:
    """int64 offsets below 4096, two to three bytes."""
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_zeros(1)])
    pairs = idx.view(-1, 2)
    a, b = pairs[:, 0], pairs[:, 1]
    return torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).to(torch.uint8).view(-1)


def _unpack12(raw: torch.Tensor, count: int) -> torch.Tensor:
    trip = raw.view(-1, 3).to(torch.int64)
    a = trip[:, 0] | ((trip[:, 1] & 0xF) << 8)
    b = (trip[:, 1] >> 4) | (trip[:, 2] << 4)
    return torch.stack([a, b], dim=1).view(-1)[:count]


class TopkWriter:
    """Builds one payload from consecutive chunk-aligned runs of values (as compress.QuantWriter does)."""

    block_size = CHUNK

    def __init__(self, numel: int, *, keep: int, bits: int):
        _check(keep, bits)
        self.numel, self.keep, self.bits = numel, keep, bits
        self.limit = qmax(bits)
        self.total = kept_total(numel, keep)
        self.out = bytearray(encoded_size(numel, keep, bits))
        self._scales = torch.zeros(num_chunks(numel), dtype=torch.float32)
        self._idx = torch.zeros(self.total, dtype=torch.int64)
        self._q = torch.zeros(self.total, dtype=torch.uint8)
        self._written = 0

    def write(self, lo: int, values: torch.Tensor) -> None:
        """Values ``lo .. lo + len(values)``; ``lo`` starts a chunk, and only the last run may end mid-chunk."""
        n = values.numel()
        assert lo % CHUNK == 0 and lo + n <= self.numel and (n % CHUNK == 0 or lo + n == self.numel)
        if n == 0:
            return
        c0, full = lo // CHUNK, n // CHUNK
        at = kept_total(lo, self.keep)
        if full:
            self._chunks(c0, at, values[:full * CHUNK].view(full, CHUNK))
            at += full * kept_in(CHUNK, self.keep)
        rest = n - full * CHUNK
        if rest:
            self._chunks(c0 + full, at, values[full * CHUNK:].view(1, rest))
        self._written += n
        if self._written == self.numel:
            self._finish()

    def _chunks(self, c0: int, at: int, rows: torch.Tensor) -> None:
        k = kept_in(rows.shape[1], self.keep)
        magnitude = rows.abs()
        # A nan or inf anywhere in a chunk makes its largest magnitude non-finite: checked on those alone.
        if not torch.isfinite(magnitude.amax(dim=1)).all():
            raise ValueError("cannot encode non-finite values (nan or inf in the update)")
        idx = magnitude.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        vals = rows.gather(1, idx)
        scales = vals.abs().amax(dim=1) / self.limit
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(vals / safe[:, None]).clamp_(-self.limit, self.limit)
        count = rows.shape[0] * k
        self._scales[c0:c0 + rows.shape[0]] = scales
        self._idx[at:at + count] = idx.reshape(-1)
        self._q[at:at + count] = (q.reshape(-1) + self.limit).to(torch.uint8)

    def _finish(self) -> None:
        out = torch.frombuffer(self.out, dtype=torch.uint8) if self.out else torch.zeros(0, dtype=torch.uint8)
        split = 4 * self._scales.numel()
        out[:split].copy_(self._scales.view(torch.uint8))
        packed_idx = _pack12(self._idx) if self.total else torch.zeros(0, dtype=torch.uint8)
        out[split:split + packed_idx.numel()].copy_(packed_idx)
        if self.total:
            per = 8 // self.bits
            q = torch.cat([self._q, self._q.new_zeros(-self.total % per)])
            out[split + packed_idx.numel():].copy_(_pack(q, self.bits))


class TopkPayload:
    """One payload of the layout above, checked once, decoded range by range into the caller's scratch buffer.

    Holds each kept value's absolute position and decoded value (12 bytes per kept value), so a range
    decodes with two binary searches and one scatter."""

    block_size = DEFAULT_BLOCK_SIZE  # the unit callers size their scratch and chunk steps in

    def __init__(self, data, numel: int, *, keep: int, bits: int):
        _check(keep, bits)
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        expected = encoded_size(numel, keep, bits)
        if len(data) != expected:
            raise ValueError(f"top-k payload for {numel} values is {expected} bytes, got {len(data)}")
        self.numel = numel
        limit = qmax(bits)
        raw = byte_view(data)
        chunks, total = num_chunks(numel), kept_total(numel, keep)
        split = 4 * chunks
        scales = raw[:split].clone().view(torch.float32) if split else torch.zeros(0)
        if split and not (torch.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError("top-k payload has a negative or non-finite chunk scale")
        packed = index_bytes(total)
        offsets = _unpack12(raw[split:split + packed].clone(), total) if total else torch.zeros(0, dtype=torch.int64)
        u = _unpack(raw[split + packed:], bits)[:total]
        if bool((u == 2 ** bits - 1).any()):
            raise ValueError(f"top-k payload holds a value past the encoder's range of +-{limit:g}")
        q = u.to(torch.float32).sub_(limit)
        # Chunk of each kept value, and its absolute position; offsets ascend strictly inside a chunk.
        full, rest = divmod(numel, CHUNK)
        per_full, per_rest = kept_in(CHUNK, keep), kept_in(rest, keep)
        chunk = torch.cat([torch.arange(full).repeat_interleave(per_full),
                           torch.full((per_rest,), full, dtype=torch.int64)])
        lengths = torch.where(chunk < full, CHUNK, rest)
        if bool((offsets >= lengths).any()):
            raise ValueError("top-k payload has an offset past the end of its chunk")
        same = chunk[1:] == chunk[:-1]
        if bool((same & (offsets[1:] <= offsets[:-1])).any()):
            raise ValueError("top-k payload's offsets do not ascend strictly inside a chunk")
        self.positions = chunk * CHUNK + offsets
        self.values = q * scales[chunk] if total else torch.zeros(0)

    def scratch(self, numel: int) -> torch.Tensor:
        return torch.empty(numel + 2 * self.block_size, dtype=torch.float32)

    def decode(self, lo: int, hi: int, scratch: torch.Tensor) -> torch.Tensor:
        """float32 values lo .. hi (zero where nothing was kept), in a view of ``scratch``."""
        out = scratch[:hi - lo].zero_()
        a = int(torch.searchsorted(self.positions, lo))
        b = int(torch.searchsorted(self.positions, hi))
        out[self.positions[a:b] - lo] = self.values[a:b]
        return out
