"""The round's streaming tensor code against the plain reference functions: the same bits, chunk by chunk."""

from __future__ import annotations

import json

import pytest
import torch

from node.tasks import compute, task_files
from node.train import compress
from node.train.codecs import CODECS
from node.train.compress import decode_int8, encode_int8, quantize_int8, tensor_bytes
from node.train.diloco import OuterNesterov, flatten, save_named, unflatten, weighted_mean_by_peer, weights_hash
from protocol.errors import IntegrityError
from tests.tasks.conftest import tiny_spec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # Chunks of 3 blocks, so small tensors cross chunk, slice and tensor boundaries in every way.
    monkeypatch.setattr(compress, "CHUNK_BLOCKS", 3)
    monkeypatch.setattr(compute, "CHUNK_BLOCKS", 3)


def rand(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


MODEL = {"emb": (37, 29), "b": (5,), "w": (300, 7), "z": (1,)}


def named(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {name: rand(seed + i, *shape, scale=scale) for i, (name, shape) in enumerate(sorted(MODEL.items()))}


def test_encode_is_quantize_int8s_bytes():
    for n in (0, 1, 255, 256, 257, 3 * 256, 3 * 256 + 1, 10 * 256 + 77):
        x = rand(n, n)
        x[: n // 3] = 0.0  # whole zero blocks keep scale 0
        q, scales = quantize_int8(x)
        assert bytes(encode_int8(x)) == tensor_bytes(scales) + tensor_bytes(q), n


@pytest.mark.parametrize("num_slices", [1, 3, 7])
def test_split_update_is_flatten_then_encode(num_slices):
    delta = named(1, 1e-3)
    flat, _ = flatten(delta)
    expected = [bytes(encode_int8(flat[a:b].contiguous()))
                for a, b in compute.slice_bounds(flat.numel(), num_slices)]
    assert [bytes(p) for p in compute.split_update(delta, num_slices)] == expected


def test_aggregate_is_decode_then_weighted_mean_then_encode():
    numel = 11 * 256 + 13
    slices = {f"p{i}": (encode_int8(rand(i, numel, scale=0.01)), 10 + 7 * i) for i in (2, 0, 1)}
    mean = weighted_mean_by_peer({p: ({"x": decode_int8(d, numel)}, float(w)) for p, (d, w) in slices.items()})
    out, bad = compute.aggregate_payload(slices, numel)
    assert bad == [] and bytes(out) == bytes(encode_int8(mean["x"]))
    # A producer whose scales are broken is left out, and the rest aggregate as if it never sent.
    broken = bytearray(slices["p1"][0])
    broken[:4] = tensor_bytes(torch.tensor([float("nan")]))
    out2, bad2 = compute.aggregate_payload({**slices, "p1": (broken, 17)}, numel)
    rest = {p: v for p, v in slices.items() if p != "p1"}
    assert bad2 == ["p1"] and bytes(out2) == bytes(compute.aggregate_payload(rest, numel)[0])


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_apply_aggregates_is_the_outer_step_bit_for_bit(name):
    codec = CODECS[name]  # the task's aggregate_compression
    weights, layout = named(10), None
    reference = OuterNesterov(lr=0.7, momentum=0.9)
    state = compute.OuterState(round=0, weights=weights, outer=OuterNesterov(lr=0.7, momentum=0.9))
    params = weights
    for r in range(3):  # the first step starts the momentum; the later ones use it
        flat, layout = flatten(named(100 + r, 1e-3))
        payloads = [codec.encode(flat[a:b].contiguous()) for a, b in compute.slice_bounds(flat.numel(), 4)]
        update = unflatten(torch.cat([codec.decode(p, b - a) for p, (a, b) in
                                      zip(payloads, compute.slice_bounds(flat.numel(), 4))]), layout)
        params = reference.step(params, update)
        before = weights_hash(state.weights)
        with pytest.raises(IntegrityError, match="aggregate"):  # read with another codec: refused
            compute.apply_aggregates(state, payloads, work=r + 1, codec=CODECS["int2" if name == "int8" else "int8"])
        state = compute.apply_aggregates(state, payloads, work=r + 1, codec=codec)
        assert weights_hash(state.weights) == weights_hash(params)
        assert weights_hash(state.outer.buffers) == weights_hash(reference.buffers)
        assert state.round == r + 1 and state.work == r + 1
        assert before != weights_hash(state.weights)


def test_state_hash_covers_the_momentum_and_is_checked_on_fetch():
    state = compute.OuterState(round=0, weights=named(3), outer=OuterNesterov())
    flat, _ = flatten(named(4, 1e-3))
    stepped = compute.apply_aggregates(state, [encode_int8(flat)], work=1)
    other = compute.OuterState(round=1, weights=stepped.weights, outer=OuterNesterov())
    other.outer.buffers = {n: t + 1e-6 for n, t in stepped.outer.buffers.items()}
    assert stepped.weights_hash() == other.weights_hash() and stepped.state_hash() != other.state_hash()
    tensors = stepped.state_tensors()
    spec = tiny_spec()
    with pytest.raises(IntegrityError):  # a layout not the task's model
        compute.state_from_tensors(spec, 1, tensors, weights_hash_=stepped.weights_hash(),
                                   state_hash=stepped.state_hash(), work=1)


def test_a_fetched_state_is_verified_against_both_hashes():
    spec = tiny_spec()
    state = compute.new_state(spec)
    flat, _ = flatten({n: torch.full_like(t, 1e-3) for n, t in state.weights.items()})
    stepped = compute.apply_aggregates(state, [encode_int8(flat)], work=1)
    good = dict(weights_hash_=stepped.weights_hash(), state_hash=stepped.state_hash(), work=1)
    back = compute.state_from_tensors(spec, 1, stepped.state_tensors(), **good)
    assert back.state_hash() == stepped.state_hash()
    tampered = dict(stepped.state_tensors())
    name = next(n for n in tampered if n.startswith(compute.MOMENTUM_PREFIX))
    tampered[name] = tampered[name] + 1.0
    with pytest.raises(IntegrityError):
        compute.state_from_tensors(spec, 1, tampered, **good)


def _spec():
    return tiny_spec()


def test_a_crash_between_rounds_leaves_the_last_complete_checkpoint(tmp_path):
    spec = _spec()
    first = compute.new_state(spec)
    task_files.save_checkpoint(tmp_path, first)
    flat, _ = flatten({n: torch.full_like(t, 1e-3) for n, t in first.weights.items()})
    second = compute.apply_aggregates(first, [encode_int8(flat)], work=1)
    # Round 1's weights are written and linked for the trainer, then the node dies before the rest.
    round_dir = task_files._round_dir(tmp_path, second)
    round_dir.mkdir(parents=True)
    save_named(round_dir / "weights.safetensors", second.weights, durable=False)
    task_files._link(round_dir / "weights.safetensors", tmp_path / "weights.safetensors")
    assert json.loads((tmp_path / "meta.json").read_text())["round"] == 0
    back = task_files.load_checkpoint(tmp_path, spec)
    assert back is not None and back.round == 0 and back.weights_hash() == first.weights_hash()
    assert back.state_hash() == first.state_hash()
    # ... and the trainer's file is θ_0 again, not the half-saved θ_1.
    from node.train.diloco import load_named
    assert weights_hash(load_named(tmp_path / "weights.safetensors")) == first.weights_hash()
    # The next complete round supersedes both and leaves one round on disk.
    task_files.save_weights(tmp_path, second)
    task_files.wait_checkpoint(tmp_path)
    assert task_files.load_checkpoint(tmp_path, spec).state_hash() == second.state_hash()
    assert [p.name for p in (tmp_path / task_files.CHECKPOINTS).iterdir()] == [round_dir.name]


def test_a_corrupt_checkpoint_reads_as_none(tmp_path):
    spec = _spec()
    state = compute.new_state(spec)
    flat, _ = flatten({n: torch.full_like(t, 1e-3) for n, t in state.weights.items()})
    task_files.save_checkpoint(tmp_path, compute.apply_aggregates(state, [encode_int8(flat)], work=1))
    meta = json.loads((tmp_path / "meta.json").read_text())
    for name, at in (("momentum.safetensors", -1), ("weights.safetensors", -1), ("momentum.safetensors", 12)):
        path = tmp_path / meta["dir"] / name
        good = path.read_bytes()
        data = bytearray(good)
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))
        assert task_files.load_checkpoint(tmp_path, spec) is None, (name, at)
        path.write_bytes(good)
    assert task_files.load_checkpoint(tmp_path, spec).state_hash() == meta["state_hash"]


def test_a_resync_to_another_history_at_the_same_round_keeps_the_complete_one_until_it_is_whole(tmp_path):
    spec = _spec()
    base = compute.new_state(spec)
    ones = {n: torch.full_like(t, 1e-3) for n, t in base.weights.items()}
    ours = compute.apply_aggregates(base, [encode_int8(flatten(ones)[0])], work=1)
    theirs = compute.apply_aggregates(base, [encode_int8(-flatten(ones)[0])], work=2)
    assert ours.round == theirs.round and ours.weights_hash() != theirs.weights_hash()
    task_files.save_checkpoint(tmp_path, ours)
    assert task_files._round_dir(tmp_path, theirs) != task_files._round_dir(tmp_path, ours)
    task_files.save_checkpoint(tmp_path, theirs)
    back = task_files.load_checkpoint(tmp_path, spec)
    assert back.state_hash() == theirs.state_hash() and back.work == 2


@pytest.mark.parametrize("name", ["int4", "int2", "topk"])
def test_low_bit_slices_aggregate_to_the_mean_of_their_decoded_values(name):
    codec = CODECS[name]
    updates = {f"p{i}": named(10 + i, scale=1e-2) for i in range(3)}
    samples = {"p0": 8, "p1": 8, "p2": 16}
    payloads = {p: compute.split_update(d, 3, codec) for p, d in updates.items()}
    numel = sum(t.numel() for t in updates["p0"].values())
    for s, (a, b) in enumerate(compute.slice_bounds(numel, 3)):
        got, _, bad = compute.aggregate({p: (payloads[p][s], samples[p]) for p in updates}, b - a, codec)
        assert bad == []
        decoded = {p: codec.decode(payloads[p][s], b - a) for p in updates}
        acc = torch.zeros(b - a)
        for p in sorted(updates):
            acc = acc + decoded[p] * torch.tensor(samples[p] / 32.0)
        assert got == encode_int8(acc)  # the aggregate is int8 unless the task names another, whatever was sent
        as_int4, _, _ = compute.aggregate({p: (payloads[p][s], samples[p]) for p in updates}, b - a, codec,
                                          CODECS["int4"])
        assert as_int4 == CODECS["int4"].encode(acc)
        with pytest.raises(IntegrityError):
            compute.aggregate({"p0": (payloads["p0"][s], 8)}, b - a)  # read as int8: refused


def test_a_top_k_slice_that_does_not_decode_is_left_out_and_its_producer_named():
    topk = CODECS["topk"]
    updates = {f"p{i}": named(20 + i, scale=1e-2) for i in range(3)}
    numel = sum(t.numel() for t in updates["p0"].values())
    slices = {p: (compute.split_update(d, 1, topk)[0], 8) for p, d in updates.items()}
    bad = bytearray(slices["p1"][0])
    at = 4 * -(-numel // 4096)
    bad[at:at + 3] = bytes([5, 0, 0])  # the first two offsets 5 and 0: not ascending
    slices["p1"] = (bad, 8)
    _, _, left_out = compute.aggregate(slices, numel, topk)
    assert left_out == ["p1"]
    with pytest.raises(IntegrityError, match="topk"):
        compute.decode_slice(bad, numel, topk)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "topk"])
def test_the_residual_is_exactly_what_a_reader_does_not_decode(codec):
    # The dense writers work the residual out as they encode, blocks crossing tensors and slices included; it must
    # be the bits of decoding the payloads, or the feedback drifts from what peers actually received.
    codec = CODECS[codec]
    delta, carried = named(5, scale=1e-2), named(9, scale=1e-4)
    delta[sorted(delta)[0]].view(-1)[:300] = 0.0  # whole zero blocks: scale 0
    for residual in (None, carried):
        payloads, left = compute.split_with_feedback(delta, 3, codec, residual)
        corrected = flatten(delta)[0] + (flatten(residual)[0] if residual else 0.0)
        sent = torch.cat([codec.decode(p, b - a) for p, (a, b) in
                          zip(payloads, compute.slice_bounds(corrected.numel(), 3))])
        assert payloads == compute.split_update({n: delta[n] + (residual[n] if residual else 0.0) for n in delta},
                                                3, codec)
        assert torch.equal(flatten(left)[0], corrected - sent)
        assert {n: t.shape for n, t in left.items()} == {n: t.shape for n, t in delta.items()}


def test_error_feedback_residuals_are_what_the_slices_dropped_and_a_redo_reuses_the_first_input(tmp_path):
    delta = named(3, scale=1e-2)
    int2 = CODECS["int2"]
    payloads, residual = compute.split_with_feedback(delta, 2, int2, None)
    assert payloads == compute.split_update(delta, 2, int2)
    flat = torch.cat([int2.decode(p, b - a) for p, (a, b) in
                      zip(payloads, compute.slice_bounds(sum(t.numel() for t in delta.values()), 2))])
    assert torch.allclose(flatten(residual)[0], flatten(delta)[0] - flat)
    # The next update carries the residual; one for another model is ignored.
    again, _ = compute.split_with_feedback(delta, 2, int2, residual)
    assert again == compute.split_update({n: delta[n] + residual[n] for n in delta}, 2, int2)
    assert compute.split_with_feedback(delta, 2, int2, {"other": torch.zeros(3)})[0] == payloads
    # On disk: round 4's update starts from round 3's residual; redoing round 4 starts from it again.
    task_files.save_residual(tmp_path, 2, named(1))
    task_files.save_residual(tmp_path, 3, residual)
    assert task_files.load_residual(tmp_path, 0) is None
    assert torch.equal(flatten(task_files.load_residual(tmp_path, 4))[0], flatten(residual)[0])
    assert not (tmp_path / "residual-r2.safetensors").exists()  # superseded
    task_files.save_residual(tmp_path, 4, named(2))
    assert torch.equal(flatten(task_files.load_residual(tmp_path, 4))[0], flatten(residual)[0])
    (tmp_path / "residual-r4.safetensors").write_bytes(b"torn")
    assert task_files.load_residual(tmp_path, 5) is None


def test_a_residual_that_could_not_be_written_fails_no_later_round(tmp_path, caplog):
    # Written in a thread: its error (here a file where the task directory should be) reaches the next save or
    # load as a warning, never as a failure of that round's update.
    blocker = tmp_path / "task"
    blocker.write_bytes(b"")
    directory = blocker / "sub"
    task_files.save_residual(directory, 1, named(1), background=True)
    assert task_files.load_residual(directory, 2) is None
    assert "residual was not saved" in caplog.text
    blocker.unlink()
    directory.mkdir(parents=True)
    task_files.save_residual(directory, 2, named(2), background=True)
    assert torch.equal(flatten(task_files.load_residual(directory, 3))[0], flatten(named(2))[0])
