"""4- and 2-bit block quantization: the layout, its bounds, streaming equals whole, and error feedback."""

import pytest
import torch

from node.train.compress import (BITS, DEFAULT_BLOCK_SIZE, ErrorFeedback, QuantPayload, QuantWriter, decode_blocks,
                                  encode_blocks, encode_int8, encoded_size, qmax)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("numel", [1, 3, 255, 256, 257, 1000, 70_001])
def test_each_value_is_within_half_a_step_of_its_block(bits, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    data = encode_blocks(x, bits=bits)
    assert len(data) == encoded_size(numel, bits=bits) == 4 * -(-numel // 256) + -(-numel * bits // 8)
    y = decode_blocks(data, numel, bits=bits)
    blocks = torch.nn.functional.pad(x, (0, -numel % 256)).view(-1, 256)
    step = (blocks.abs().amax(dim=1) / qmax(bits)).repeat_interleave(256)[:numel]
    assert torch.all((x - y).abs() <= step / 2 + 1e-6)


def test_the_packed_layout_is_the_documented_one():
    # One block of 5 values at 2 bits: scale 3 / 1, q = round(x / 3) in -1..1 stored as q + 1, first value lowest.
    x = torch.tensor([3.0, -3.0, 0.0, 1.6, -1.4])
    data = encode_blocks(x, bits=2)
    assert bytes(data[:4]) == torch.tensor([3.0]).numpy().tobytes()
    q = [1, -1, 0, 1, 0]
    u = [v + 1 for v in q]
    assert data[4] == u[0] | u[1] << 2 | u[2] << 4 | u[3] << 6 and data[5] == u[4]  # padding bits are zero
    x4 = torch.tensor([7.0, -7.0, 2.0])
    d4 = encode_blocks(x4, bits=4)
    assert d4[4] == (7 + 7) | (-7 + 7) << 4 and d4[5] == 2 + 7


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_streaming_writes_and_range_decodes_match_the_whole(bits):
    n = 3 * 4096 * DEFAULT_BLOCK_SIZE // 2 + 77
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    whole = encode_blocks(x, bits=bits)
    w = QuantWriter(n, bits=bits)
    for lo in range(0, n, 5 * DEFAULT_BLOCK_SIZE):
        w.write(lo, x[lo:lo + 5 * DEFAULT_BLOCK_SIZE])
    assert w.out == whole
    p = QuantPayload(whole, n, bits=bits)
    full = decode_blocks(whole, n, bits=bits)
    scratch = p.scratch(10_000)
    for lo, hi in [(0, 1), (100, 9000), (n - 300, n), (256, 512)]:
        assert torch.equal(p.decode(lo, hi, scratch), full[lo:hi])


def test_int8_is_unchanged_by_the_generalisation():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert encode_blocks(x, bits=8) == encode_int8(x)


@pytest.mark.parametrize("bits", [4, 2])
def test_a_payload_of_the_wrong_length_or_with_a_bad_scale_is_refused(bits):
    data = encode_blocks(torch.randn(600), bits=bits)
    with pytest.raises(ValueError, match="bytes"):
        QuantPayload(data + b"\0", 600, bits=bits)
    with pytest.raises(ValueError, match="bytes"):
        QuantPayload(data, 600, bits=8)  # read at the wrong width
    bad = bytearray(data)
    bad[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(ValueError, match="scale"):
        QuantPayload(bad, 600, bits=bits)
    with pytest.raises(ValueError, match="bits"):
        QuantPayload(data, 600, bits=3)


@pytest.mark.parametrize("bits, past", [(8, 0x80), (4, 0x0F), (4, 0xF0), (2, 0x03), (2, 0x0C), (2, 0x30), (2, 0xC0)])
def test_a_value_one_step_past_the_encoders_range_is_refused(bits, past):
    """int8 -128, a 4-bit 15 or a 2-bit 3 would decode as a value no encoder writes (8x the scale at 4 bits),
    in whichever lane of its byte the value sits."""
    data = encode_blocks(torch.randn(600, generator=torch.Generator().manual_seed(2)), bits=bits)
    QuantPayload(data, 600, bits=bits)  # the honest payload is accepted
    bad = bytearray(data)
    at = 4 * 3 + 100  # a value in the second block (after three scales)
    bad[at] = past if bits == 8 else bad[at] | past  # int8: exactly -128; low bits: one value's bits all set
    with pytest.raises(ValueError, match="past the encoder's range"):
        QuantPayload(bad, 600, bits=bits)
    with pytest.raises(ValueError, match="past the encoder's range"):
        decode_blocks(bad, 600, bits=bits)


@pytest.mark.parametrize("bits", [4, 2])
def test_error_feedback_keeps_the_sum_of_what_was_sent_close_to_the_sum_of_the_updates(bits):
    # The same small update every round: without feedback 2 bits round much of it to zero every time; with
    # it, the residual carries what was dropped, so the running sums stay within one round's error.
    gen = torch.Generator().manual_seed(2)
    update = torch.randn(4096, generator=gen) * torch.rand(4096, generator=gen)
    ef = ErrorFeedback(bits=bits)
    sent = plain = torch.zeros(4096)
    for _ in range(30):
        sent = sent + decode_blocks(ef.encode("d", update), 4096, bits=bits)
        plain = plain + decode_blocks(encode_blocks(update, bits=bits), 4096, bits=bits)
    target = 30 * update
    assert (sent - target).norm() < 0.1 * (plain - target).norm()
    assert (sent - target).abs().max() <= ef.residuals["d"].abs().max() + 1e-4


def test_the_known_compressions_are_the_ones_a_spec_may_name():
    from node.train.codecs import CODECS
    from protocol.task import KNOWN_COMPRESSIONS
    assert BITS == {"int8": 8, "int4": 4, "int2": 2} and set(KNOWN_COMPRESSIONS) == set(CODECS) == {*BITS, "topk"}
