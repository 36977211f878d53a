"""Robust aggregation of a slice: the same bits on every node, the plain mean unchanged, outliers held back."""

from __future__ import annotations

import hashlib

import pytest
import torch

from node.tasks import compute, robust
from node.train import compress
from node.train.compress import decode_int8, encode_int8, tensor_bytes
from protocol.errors import IntegrityError
from protocol.task import AggregationSpec

pytestmark = pytest.mark.timeout(60)

RULES = [AggregationSpec(rule="mean", norm_bound=2.0), AggregationSpec(rule="trimmed_mean", norm_bound=2.0),
         AggregationSpec(rule="median"), AggregationSpec(rule="median", norm_bound=1.5),
         AggregationSpec(rule="centered_clip", norm_bound=2.0), AggregationSpec(rule="centered_clip", clip_radius=0.5)]


def rand(seed: int, n: int, scale: float = 0.01) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def honest(numel: int, peers: int = 5) -> dict:
    """Updates that agree on a common direction, as honest pseudo-gradients roughly do, with their own noise."""
    return {f"p{i}": (encode_int8(rand(100, numel) + rand(i, numel) * 0.5), 10 + 3 * i) for i in range(peers)}


def decoded(slices: dict, numel: int) -> torch.Tensor:
    return torch.stack([decode_int8(slices[p][0], numel) for p in sorted(slices)]).double()


def test_plain_mean_is_todays_bytes():
    # Pinned: the plain mean through aggregate_slice is aggregate_payload, and aggregate_payload is what it was.
    numel = 11 * 256 + 13
    slices = honest(numel)
    out, bad = robust.aggregate_slice(slices, numel)
    assert bad == [] and bytes(out) == bytes(compute.aggregate_payload(slices, numel)[0])
    assert hashlib.sha256(out).hexdigest() == "35b7f3536146db60e96ae50b39c819650d15d746019b81fd01699c1a86b8c1ac"


@pytest.mark.parametrize("spec", RULES, ids=lambda s: f"{s.rule}-{s.norm_bound}-{s.clip_radius}")
def test_same_bytes_whatever_the_dict_order_threads_and_chunks(spec, monkeypatch):
    numel = 300_000 + 77  # past torch's parallel grain, so more threads would split a careless reduction
    slices = honest(numel, peers=6)
    slices["p9"] = (encode_int8(rand(9, numel, scale=0.5)), 40)  # an outlier, so the bound and the clip act
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n_threads, order in ((1, sorted(slices)), (4, sorted(slices, reverse=True)), (2, list(slices))):
            torch.set_num_threads(n_threads)
            outputs.append(bytes(robust.aggregate_slice({p: slices[p] for p in order}, numel, spec)[0]))
        monkeypatch.setattr(compute, "CHUNK_BLOCKS", 5)  # chunks of 1280 values: the streaming must not matter
        monkeypatch.setattr(robust, "STACK_VALUES", 7 * 3 * 256)  # and the stack's chunk neither
        outputs.append(bytes(robust.aggregate_slice(slices, numel, spec)[0]))
    finally:
        torch.set_num_threads(threads)
    assert len(set(outputs)) == 1


def _reference(spec: AggregationSpec, x: torch.Tensor, samples: list[int]) -> torch.Tensor:
    """The rule in float64 on whole tensors, the textbook way."""
    if spec.norm_bound:
        norms = x.norm(dim=1)
        limit = spec.norm_bound * norms.median() if len(norms) % 2 else spec.norm_bound * norms.sort().values[
            len(norms) // 2 - 1:len(norms) // 2 + 1].mean()
        x = x * torch.clamp(limit / norms, max=1.0)[:, None]
    n = x.shape[0]
    ordered = x.sort(dim=0).values
    median = ordered[n // 2] if n % 2 else ordered[n // 2 - 1:n // 2 + 1].mean(dim=0)
    if spec.rule == "mean":
        w = torch.tensor(samples, dtype=torch.float64)
        return (x * (w / w.sum())[:, None]).sum(dim=0)
    if spec.rule == "median":
        return median
    if spec.rule == "trimmed_mean":
        t = int(spec.trim_fraction * n)
        return ordered[t:n - t].mean(dim=0)
    d = (x - median).norm(dim=1)
    tau = spec.clip_radius * d.median() if n % 2 else spec.clip_radius * d.sort().values[n // 2 - 1:n // 2 + 1].mean()
    return median + ((x - median) * torch.clamp(tau / d, max=1.0)[:, None]).mean(dim=0)


@pytest.mark.parametrize("spec", RULES, ids=lambda s: f"{s.rule}-{s.norm_bound}-{s.clip_radius}")
@pytest.mark.parametrize("peers", [4, 5])
def test_each_rule_is_its_textbook_definition(spec, peers, monkeypatch):
    monkeypatch.setattr(compute, "CHUNK_BLOCKS", 3)
    numel = 9 * 256 + 5
    slices = honest(numel, peers=peers)
    slices["p0"] = (encode_int8(rand(0, numel, scale=0.3)), 10)
    expected = _reference(spec, decoded(slices, numel), [slices[p][1] for p in sorted(slices)]).float()
    got = decode_int8(robust.aggregate_slice(slices, numel, spec)[0], numel)
    step = expected.abs().max() / 127  # one int8 step of the largest block bounds the quantization error
    assert (got - expected).abs().max() <= step


def test_a_huge_update_is_held_back():
    numel = 4 * 256
    slices = honest(numel, peers=4)
    truth = decoded({p: slices[p] for p in ("p1", "p2", "p3")}, numel).mean(dim=0)
    slices["p0"] = (encode_int8(rand(0, numel) * -1000.0), 10)
    errors = {}
    for spec in [AggregationSpec(), *RULES]:
        out = decode_int8(robust.aggregate_slice(slices, numel, spec)[0], numel).double()
        errors[(spec.rule, spec.norm_bound)] = float((out - truth).norm() / truth.norm())
    assert errors[("mean", 0.0)] > 100  # the plain mean follows the attacker
    assert errors[("mean", 2.0)] < 1.5  # the bound caps it at twice the median norm
    assert all(e < 1.0 for (rule, _), e in errors.items() if rule != "mean")


def test_undecodable_and_overflowing_slices_are_left_out():
    numel = 3 * 256
    slices = honest(numel, peers=4)
    broken = bytearray(slices["p1"][0])
    broken[:4] = tensor_bytes(torch.tensor([float("nan")]))
    huge = bytearray(slices["p2"][0])
    huge[:4] = tensor_bytes(torch.tensor([1e20]))  # finite, but no update moves weights that far
    rest = {p: slices[p] for p in ("p0", "p3")}
    spec = AggregationSpec(rule="median", norm_bound=2.0)
    out, bad = robust.aggregate_slice({**slices, "p1": (broken, 1), "p2": (huge, 1)}, numel, spec)
    assert bad == ["p1", "p2"] and bytes(out) == bytes(robust.aggregate_slice(rest, numel, spec)[0])
    with pytest.raises(IntegrityError):
        robust.aggregate_slice({"p1": (broken, 1)}, numel, spec)


def test_one_producer_is_passed_through_by_every_rule():
    numel = 2 * 256 + 3
    slices = {"only": (encode_int8(rand(3, numel)), 5)}
    for spec in RULES:
        assert bytes(robust.aggregate_slice(slices, numel, spec)[0]) == bytes(compute.aggregate_payload(slices, numel)[0])


def test_streaming_keeps_chunks_small(monkeypatch):
    # The stack holds a chunk per producer, never a whole slice per producer.
    monkeypatch.setattr(compress, "CHUNK_BLOCKS", 2)
    monkeypatch.setattr(compute, "CHUNK_BLOCKS", 2)
    numel = 40 * 256
    agg = robust._Slices({p: compress.QuantPayload(v[0], numel) for p, v in honest(numel).items()}, numel,
                         [None] * 5)
    assert agg.stack.shape == (5, 2 * 256)


def test_a_slice_that_overflows_the_plain_mean_is_left_out_not_fatal():
    numel = 3 * 256
    slices = honest(numel, peers=3)
    huge = bytearray(slices["p1"][0])
    huge[:4] = tensor_bytes(torch.tensor([3e38]))  # a valid payload whose values overflow float32 when decoded
    with pytest.raises(ValueError):
        compute.aggregate_payload({**slices, "p1": (huge, 13)}, numel)
    out, bad = robust.aggregate_slice({**slices, "p1": (huge, 13)}, numel)
    rest = {p: slices[p] for p in ("p0", "p2")}
    assert bad == ["p1"] and bytes(out) == bytes(compute.aggregate_payload(rest, numel)[0])
