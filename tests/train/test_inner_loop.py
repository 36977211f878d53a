"""The inner loop learns, replays bit-identically from its seed, and honours its time budget."""

import pytest

from node.train.data import build_corpus, split_corpus
from node.train.diloco import named_tensors, weights_hash
from node.train.inner import AdamWConfig, evaluate, train_inner
from node.train.model import ModelConfig, init_model

TINY = ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=32)


@pytest.fixture(scope="module")
def corpus():
    return split_corpus(build_corpus(128 * 1024), 4)


def run(shards, **overrides):
    kwargs = dict(model_config=TINY, base_weights=named_tensors(init_model(TINY, 0)), data=shards[0], steps=25,
                  batch_size=8, seed=7, adamw=AdamWConfig(lr=1e-2), log_every=10)
    kwargs.update(overrides)
    return train_inner(**kwargs)


def test_loss_decreases_and_commitments_are_recorded(corpus):
    shards, heldout = corpus
    result = run(shards)
    assert [s for s, _ in result.losses] == [0, 10, 20, 24]
    assert result.losses[-1][1] < result.losses[0][1] - 1.0
    assert result.steps == 25 and result.samples == 200
    base = named_tensors(init_model(TINY, 0))
    assert evaluate(TINY, result.weights, heldout, 4, seed=1) < evaluate(TINY, base, heldout, 4, seed=1)


def test_same_inputs_replay_to_the_same_bits(corpus):
    shards, _ = corpus
    a, b = run(shards, steps=5), run(shards, steps=5)
    assert a.losses == b.losses and weights_hash(a.weights) == weights_hash(b.weights)
    assert weights_hash(run(shards, steps=5, seed=8).weights) != weights_hash(a.weights)


def test_optimizer_state_carries_across_rounds(corpus):
    shards, _ = corpus
    first = run(shards, steps=3)
    assert first.opt_state["step"].item() == 3
    second = run(shards, steps=3, base_weights=first.weights, opt_state=first.opt_state)
    assert second.opt_state["step"].item() == 6
    with pytest.raises(ValueError, match="optimizer state"):
        run(shards, steps=1, opt_state={"step": first.opt_state["step"]})


def test_time_budget_stops_early(corpus):
    shards, _ = corpus
    result = run(shards, steps=10_000, time_budget_s=0.2)
    assert 1 <= result.steps < 10_000 and result.samples == 8 * result.steps
    assert result.losses[-1][0] == result.steps - 1


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError):
        AdamWConfig(lr=0)
    with pytest.raises(ValueError):
        AdamWConfig.from_dict({"learning_rate": 1e-3})


def test_device_choice_falls_back_to_the_cpu_and_refuses_a_missing_gpu():
    import torch

    from node.train.inner import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")


def test_rebase_keeps_the_steps_taken_since_the_update_was_sent():
    import torch

    from node.train.diloco import named_tensors
    from node.train.inner import InnerLoop
    from node.train.model import init_model

    config = ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=16)
    start = named_tensors(init_model(config, 0))
    loop = InnerLoop(model_config=config, weights=start)
    loop.feed(build_corpus(8 * 1024), 4, seed=1)
    for _ in range(3):
        loop.step()
    sent = loop.weights()
    for _ in range(2):  # steps ahead, while the round's exchange would run
        loop.step()
    ahead = loop.weights()
    new_base = {n: t + 0.5 for n, t in start.items()}
    loop.rebase(new_base, sent)
    after = loop.weights()
    for name in start:
        torch.testing.assert_close(after[name], new_base[name] + (ahead[name] - sent[name]))
    with pytest.raises(ValueError, match="do not match"):
        loop.rebase({"x": torch.zeros(1)}, sent)
