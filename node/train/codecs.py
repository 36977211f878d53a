"""The update compressions a task may name, behind one interface: size, writer, view, decode.

Dense block quantization at 8, 4 or 2 bits (compress.py) and chunked top-k with 4-bit values
(sparse.py). Aggregates are dense (int8, int4 or int2, protocol.task AGGREGATE_COMPRESSIONS): a mean of
several producers fills every value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node.train import sparse
from node.train.compress import CHUNK_BLOCKS, DEFAULT_BLOCK_SIZE, QuantPayload, QuantWriter, encode_blocks, encoded_size


@dataclass(frozen=True)
class Codec:
    name: str
    bits: int
    keep: int = 0
    """Values kept per sparse.CHUNK (top-k); 0 for dense blocks."""

    @property
    def block_size(self) -> int:
        """The alignment a writer needs between runs of values."""
        return sparse.CHUNK if self.keep else DEFAULT_BLOCK_SIZE

    @property
    def feedback(self) -> bool:
        """Whether a producer keeps what this codec drops and adds it to its next update (below 8 bits, top-k)."""
        return self.bits < 8 or bool(self.keep)

    def size(self, numel: int) -> int:
        """Bytes of a payload of ``numel`` values: fixed by the codec, so a wrong length is refused unread."""
        return sparse.encoded_size(numel, self.keep, self.bits) if self.keep else encoded_size(numel, bits=self.bits)

    def writer(self, numel: int):
        """A writer (``write(lo, values)``, ``out``) of one payload."""
        if self.keep:
            return sparse.TopkWriter(numel, keep=self.keep, bits=self.bits)
        return QuantWriter(numel, bits=self.bits)

    def open(self, data, numel: int):
        """The payload checked and viewed (``decode(lo, hi, scratch)``, ``scratch(n)``); ValueError if malformed."""
        if self.keep:
            return sparse.TopkPayload(data, numel, keep=self.keep, bits=self.bits)
        return QuantPayload(data, numel, bits=self.bits)

    def encode(self, flat: torch.Tensor) -> bytearray:
        if not self.keep:
            return encode_blocks(flat, bits=self.bits)
        writer = self.writer(flat.numel())
        step = CHUNK_BLOCKS * self.block_size
        for lo in range(0, flat.numel(), step):
            writer.write(lo, flat[lo:lo + step])
        return writer.out

    def decode(self, data, numel: int) -> torch.Tensor:
        view = self.open(data, numel)
        return view.decode(0, numel, view.scratch(numel)).clone() if numel else torch.zeros(0)


INT8 = Codec("int8", 8)
CODECS = {c.name: c for c in (INT8, Codec("int4", 4), Codec("int2", 2), Codec("topk", 4, keep=64))}
"""By the name a task spec gives (protocol/task.py KNOWN_COMPRESSIONS)."""
