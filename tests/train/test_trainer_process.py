"""The trainer child: frames in-process, then a real child process driven through the trio client."""

import io
import os
import signal

import msgpack
import pytest
import torch
import trio

from node.train.client import TrainerCrashed, TrainerRequestFailed, open_trainer
from node.train.data import build_corpus, split_ranges
from node.train.diloco import load_named, save_named
from node.train.model import ModelConfig, init_model
from node.train.diloco import named_tensors
from node.train.worker import MAX_FRAME_BYTES, read_frame, serve

TINY = ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=16)


def frames(*messages):
    out = b""
    for m in messages:
        payload = m if isinstance(m, bytes) else msgpack.packb(m)
        out += len(payload).to_bytes(4, "big") + payload
    return out


def replies(raw):
    stream, out = io.BytesIO(raw), []
    while (payload := read_frame(stream)) is not None:
        out.append(msgpack.unpackb(payload))
    return out


def test_worker_answers_and_survives_bad_requests():
    oversize = (MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"\x00" * (MAX_FRAME_BYTES + 1)
    stdin = io.BytesIO(frames({"op": "ping", "id": 1}, {"op": "nope", "id": 2}, b"\xc1", [1, 2]) + oversize
                       + frames({"op": "train", "id": 3}, {"op": "ping", "id": 4}))
    stdout = io.BytesIO()
    assert serve(stdin, stdout) == 0
    got = replies(stdout.getvalue())
    assert [(r["id"], r["ok"]) for r in got] == [(1, True), (2, False), (None, False), (None, False), (None, False),
                                                 (3, False), (4, True)]
    assert "unknown op" in got[1]["error"] and "cap" in got[4]["error"] and "missing" in got[5]["error"]


def test_worker_exits_nonzero_on_a_torn_frame():
    assert serve(io.BytesIO(b"\x00\x00\x00\x09abc"), io.BytesIO()) == 1


@pytest.fixture
def files(tmp_path):
    data = build_corpus(64 * 1024)
    (tmp_path / "corpus").write_bytes(data)
    base = named_tensors(init_model(TINY, 0))
    save_named(tmp_path / "base.safetensors", base)
    shard_ranges, heldout = split_ranges(len(data), 4)
    return tmp_path, base, shard_ranges, heldout


@pytest.mark.slow
async def test_client_trains_evaluates_and_recovers_from_a_killed_child(files):
    tmp, base, shard_ranges, heldout = files
    common = dict(model=TINY, data_path=tmp / "corpus", seed=3, num_batches=2)
    async with open_trainer() as trainer:
        with trio.fail_after(60):
            assert (await trainer.ping())["pid"] == trainer.pid
            result = await trainer.train(
                model=TINY, base_path=tmp / "base.safetensors", data_path=tmp / "corpus",
                shard_ranges=shard_ranges[:2], steps=3, batch_size=4, seed=1, out_path=tmp / "delta.safetensors",
                adamw={"lr": 1e-2}, opt_state_path=tmp / "adam.safetensors", log_every=1,
            )
            assert result.steps == 3 and result.samples == 12 and len(result.losses) == 3
            delta = load_named(tmp / "delta.safetensors")  # Δ = base − trained, named as the base
            assert {n: t.shape for n, t in delta.items()} == {n: t.shape for n, t in base.items()}
            assert all(bool(torch.isfinite(t).all()) for t in delta.values())
            assert any(bool(t.abs().sum() > 0) for t in delta.values())
            assert (tmp / "adam.safetensors").exists()
            loss = await trainer.evaluate(weights_path=tmp / "base.safetensors", data_range=heldout, **common)
            assert 4.0 < loss < 6.5  # an untrained byte model is near ln(256) = 5.55

            with pytest.raises(TrainerRequestFailed, match="byte range"):
                await trainer.evaluate(weights_path=tmp / "base.safetensors", data_range=(0, 10**9), **common)
            assert (await trainer.ping())["ok"]

            os.kill(trainer.pid, signal.SIGKILL)
            with pytest.raises(TrainerCrashed):
                await trainer.ping()
            with pytest.raises(TrainerCrashed, match="restart"):
                await trainer.ping()
            await trainer.restart()
            assert (await trainer.ping())["ok"]


@pytest.mark.slow
async def test_a_cancelled_call_kills_the_child_and_exit_reaps_it(files):
    tmp, _, shard_ranges, _ = files
    async with open_trainer() as trainer:
        with trio.fail_after(60):
            await trainer.ping()
        pid = trainer.pid
        with trio.move_on_after(0.5):
            await trainer.train(
                model=TINY, base_path=tmp / "base.safetensors", data_path=tmp / "corpus",
                shard_ranges=shard_ranges, steps=10**6, batch_size=4, seed=1, out_path=tmp / "d.safetensors",
            )
        assert not trainer.alive
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(TrainerCrashed):
            await trainer.ping()
    assert trainer.pid is None


@pytest.mark.slow
async def test_a_child_trains_ahead_during_the_exchange_and_carries_the_steps_in(files):
    """overlap: after its reply the child keeps stepping until the next request; the next round's
    request (carry) counts those steps, and its update is its own base minus where the steps ended."""
    tmp, base, shard_ranges, _ = files
    common = dict(model=TINY, data_path=tmp / "corpus", shard_ranges=shard_ranges[:2], batch_size=4,
                  adamw={"lr": 1e-2}, opt_state_path=tmp / "adam.safetensors", log_every=1)
    async with open_trainer() as trainer:
        with trio.fail_after(60):
            first = await trainer.train(base_path=tmp / "base.safetensors", steps=40, seed=1,
                                        out_path=tmp / "d0.safetensors", overlap=40, **common)
            assert first.carried_steps == 0 and first.steps == 40
            await trio.sleep(1.0)  # the "exchange": the child trains ahead meanwhile
            moved = {n: t - 0.5 for n, t in base.items()}
            save_named(tmp / "base1.safetensors", moved)
            second = await trainer.train(base_path=tmp / "base1.safetensors", steps=40, seed=2,
                                         out_path=tmp / "d1.safetensors", carry=True, overlap=40, **common)
            assert 0 < second.carried_steps <= 40 and second.steps == 40 and second.samples == 160
            update = load_named(tmp / "d1.safetensors")
            assert set(update) == set(moved)
            # The steps taken ahead moved onto the new base: the update is what 40 steps did, not also the 0.5 by
            # which the base moved meanwhile (every value would then be offset by about -0.5).
            offset = sum(float(t.sum()) for t in update.values()) / sum(t.numel() for t in update.values())
            assert abs(offset) < 0.1, offset
            assert [s for s, _ in second.losses][:2] == [0, 1]
            await trio.sleep(0.3)
            # Without carry (a re-synced or restarted node) the steps ahead are dropped.
            third = await trainer.train(base_path=tmp / "base1.safetensors", steps=5, seed=3,
                                        out_path=tmp / "d2.safetensors", **common)
            assert third.carried_steps == 0 and third.steps == 5
