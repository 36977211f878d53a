"""Chunked top-k with 4-bit values (node/train/sparse.py) behind the codec interface (node/train/codecs.py)."""

import pytest
import torch

from node.train import sparse
from node.train.codecs import CODECS, Codec
from node.train.sparse import CHUNK

TOPK = CODECS["topk"]


def rand(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 10, CHUNK, CHUNK + 1, 3 * CHUNK - 7])
def test_each_chunk_keeps_its_largest_values_quantized_and_nothing_else(n):
    x = rand(n)
    data = TOPK.encode(x)
    assert len(data) == TOPK.size(n) == sparse.encoded_size(n, TOPK.keep, 4)
    y = TOPK.decode(data, n)
    for lo in range(0, n, CHUNK):
        chunk, got = x[lo:lo + CHUNK], y[lo:lo + CHUNK]
        k = sparse.kept_in(chunk.numel(), TOPK.keep)
        top = chunk.abs().topk(k).indices.sort().values
        assert torch.equal(got.nonzero().view(-1), top[got[top] != 0])  # zeros only where a value rounds to 0
        scale = chunk[top].abs().max() / 7
        assert (got[top] - chunk[top]).abs().max() <= scale / 2 + 1e-6
    if n >= CHUNK:  # 64 of 4096 at 4 bits plus 12-bit offsets: about 1/32 of a byte per value
        assert len(data) < n / 25


def test_streaming_writes_and_range_decodes_match_the_whole():
    n = 5 * CHUNK + 123
    x = rand(n, seed=1)
    whole = TOPK.encode(x)
    writer = TOPK.writer(n)
    for lo, hi in [(0, CHUNK), (CHUNK, 3 * CHUNK), (3 * CHUNK, n)]:
        writer.write(lo, x[lo:hi])
    assert writer.out == whole
    view = TOPK.open(whole, n)
    full = TOPK.decode(whole, n)
    scratch = view.scratch(n)
    for lo, hi in [(0, 1), (5, 4100), (CHUNK, 2 * CHUNK), (n - 50, n), (100, n)]:
        assert torch.equal(view.decode(lo, hi, scratch), full[lo:hi])


def _tamper(data: bytearray, at: int, value: int) -> bytearray:
    bad = bytearray(data)
    bad[at] = value
    return bad


def test_a_malformed_payload_is_refused_before_it_is_used():
    n = 2 * CHUNK
    data = TOPK.encode(rand(n, seed=2))
    scales = 4 * sparse.num_chunks(n)
    with pytest.raises(ValueError, match="bytes"):
        TOPK.open(data[:-1], n)
    with pytest.raises(ValueError, match="scale"):
        TOPK.open(bytearray(b"\x00\x00\xc0\x7f") + data[4:], n)  # nan
    with pytest.raises(ValueError, match="scale"):
        TOPK.open(bytearray(torch.tensor([-1.0]).view(torch.uint8).numpy().tobytes()) + data[4:], n)
    # The first two offsets made equal: not strictly ascending inside the chunk.
    first = data[scales] | ((data[scales + 1] & 0xF) << 8)
    bad = _tamper(_tamper(data, scales + 1, (data[scales + 1] & 0x0F) | ((first & 0xF) << 4)), scales + 2, first >> 4)
    with pytest.raises(ValueError, match="ascend"):
        TOPK.open(bad, n)
    # A value lane of all ones (15 at 4 bits) would decode as 8x the scale.
    values = scales + sparse.index_bytes(sparse.kept_total(n, TOPK.keep))
    with pytest.raises(ValueError, match="range"):
        TOPK.open(_tamper(data, values, 0xFF), n)


def test_an_offset_past_a_short_last_chunk_is_refused():
    n = CHUNK + 100  # the last chunk holds 100 values and keeps 2
    data = TOPK.encode(rand(n, seed=3))
    total = sparse.kept_total(n, TOPK.keep)
    at = 4 * sparse.num_chunks(n)
    raw = torch.frombuffer(bytearray(data[at:at + sparse.index_bytes(total)]), dtype=torch.uint8)
    idx = sparse._unpack12(raw, total)
    idx[-1] = 200
    bad = bytearray(data)
    bad[at:at + sparse.index_bytes(total)] = bytes(sparse._pack12(idx).tolist())
    with pytest.raises(ValueError, match="past the end"):
        TOPK.open(bad, n)


def test_error_feedback_sends_the_whole_of_a_repeated_update_over_rounds():
    """With the residual carried, nothing is lost (sent + residual is the sum of the updates) and what is still
    owed stops growing, though each round sends 1/64 of the values."""
    update = rand(4 * CHUNK, seed=4) * 1e-2
    residual = torch.zeros_like(update)
    sent = torch.zeros_like(update)
    owed = {}
    for r in range(1, 401):
        corrected = update + residual
        got = TOPK.decode(TOPK.encode(corrected), update.numel())
        residual = corrected - got
        sent += got
        owed[r] = residual.norm()
    assert torch.allclose(sent + residual, 400 * update, atol=1e-3)
    assert owed[400] < 1.2 * owed[200] and owed[400] < 0.2 * (400 * update).norm()


def test_the_codec_refuses_what_it_cannot_encode():
    with pytest.raises(ValueError):
        Codec("topk", 8, keep=64).writer(10)
    with pytest.raises(ValueError):
        Codec("topk", 4, keep=0 + CHUNK + 1).writer(10)
    with pytest.raises(ValueError, match="non-finite"):
        TOPK.encode(torch.tensor([1.0, float("inf")]))
