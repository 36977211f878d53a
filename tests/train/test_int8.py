"""Block-wise int8: error bound, exact layout size, strict decoding, error feedback."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from node.train.compress import (
    ErrorFeedback, decode_int8, dequantize_int8, encode_int8, encoded_size, quantize_int8, tensor_bytes,
)


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(0, 1000), scale=st.floats(1e-6, 1e3), seed=st.integers(0, 2**31))
def test_round_trip_error_is_within_half_a_step(numel, scale, seed):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    data = encode_int8(x)
    assert len(data) == encoded_size(numel) == 4 * -(-numel // 256) + numel
    y = decode_int8(data, numel)
    assert y.dtype == torch.float32 and y.shape == x.shape
    if numel:
        _, scales = quantize_int8(x)
        step = scales.repeat_interleave(256)[:numel]
        assert ((x - y).abs() <= step * 0.5 * (1 + 1e-5) + 1e-30).all()


def test_layout_is_scales_then_values():
    x = torch.tensor([0.0, 1.27, -2.54, 0.5] + [0.0] * 256)  # two blocks, the second all zero
    data = encode_int8(x)
    q, scales = quantize_int8(x)
    assert data == tensor_bytes(torch.tensor([0.02, 0.0])) + tensor_bytes(q)
    assert q[:4].tolist() == [0, 64, -127, 25]
    assert len(data) == 2 * 4 + 260
    assert torch.equal(decode_int8(data, 260)[256:], torch.zeros(4))


def test_empty_tensor():
    assert encode_int8(torch.zeros(0)) == b""
    assert decode_int8(b"", 0).numel() == 0


@pytest.mark.parametrize("delta", [-1, 1, -5])
def test_wrong_lengths_are_refused(delta):
    data = encode_int8(torch.randn(300))
    bad = data[:delta] if delta < 0 else data + b"\x00"
    with pytest.raises(ValueError, match="bytes"):
        decode_int8(bad, 300)
    with pytest.raises(ValueError):
        decode_int8(data, 300 + delta)


def test_bad_scales_and_inputs_are_refused():
    data = bytearray(encode_int8(torch.randn(10)))
    data[:4] = tensor_bytes(torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="scale"):
        decode_int8(bytes(data), 10)
    with pytest.raises(ValueError):
        encode_int8(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError):
        encode_int8(torch.zeros(2, 2))


def test_dequantize_is_bit_stable():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    q, s = quantize_int8(x)
    assert torch.equal(dequantize_int8(q, s), dequantize_int8(q.clone(), s.clone()))


def test_error_feedback_carries_the_residual():
    ef = ErrorFeedback()
    x = torch.randn(700, generator=torch.Generator().manual_seed(1))
    sent = decode_int8(ef.encode("w", x), 700)
    assert torch.allclose(ef.residuals["w"], x - sent)
    total_sent = sent.clone()
    for _ in range(9):
        total_sent += decode_int8(ef.encode("w", x), 700)
    # Over ten rounds the drift stays one quantization residual, not ten.
    assert (total_sent - 10 * x).abs().max() <= ef.residuals["w"].abs().max() + 1e-5
    ef2 = ErrorFeedback()
    ef2.load_state_dict(ef.state_dict())
    assert ef2.encode("w", x) == ef.encode("w", x)
