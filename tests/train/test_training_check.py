"""The own-data gain (node/tasks/training_check.py) on the real TinyLM: an update trained on a producer's
batches lowers their loss; the same update flipped, or one trained on other data from other weights, raises it."""

from __future__ import annotations

import pytest
import torch

from node.tasks import training_check
from node.train.data import build_corpus, derive_seed
from node.train.diloco import flatten, named_tensors, pseudo_gradient
from node.train.inner import AdamWConfig, train_inner
from node.train.model import ModelConfig, init_model

CONFIG = ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=32)
ADAMW = AdamWConfig(lr=3e-3, weight_decay=0.0)


def _train(base, data: bytes, seed: int, steps: int = 12):
    result = train_inner(model_config=CONFIG, base_weights=base, data=data, steps=steps, batch_size=8, seed=seed,
                         adamw=ADAMW)
    return result.weights, flatten(pseudo_gradient(base, result.weights))[0]


@pytest.fixture(scope="module")
def setting():
    corpus = build_corpus(64 * 1024)
    mine, other = corpus[: len(corpus) // 2], corpus[len(corpus) // 2:]
    theta0 = named_tensors(init_model(CONFIG, 3))
    warm, _ = _train(theta0, other, seed=1, steps=60)  # a model that has learned something already
    return mine, theta0, warm


def test_an_update_lowers_the_loss_on_the_batches_it_trained_on(setting):
    mine, _, base = setting
    seed = derive_seed("t", 1, "p")
    _, delta = _train(base, mine, seed)
    own = training_check.own_batches(mine, CONFIG.seq_len, 8, seed, steps=12)
    assert len(own) == training_check.CHECK_BATCHES
    gain = training_check.own_gain(CONFIG, base, delta, own)
    assert gain > -training_check.UNTRAINED_GAIN and not training_check.untrained(gain)
    # Nothing moved, nothing gained: zeros are the screen's to catch ("empty"), not this check's.
    assert training_check.own_gain(CONFIG, base, torch.zeros_like(delta), own) == 0.0
    # Fewer steps than batches checked: only the batches it drew.
    assert len(training_check.own_batches(mine, CONFIG.seq_len, 8, seed, steps=2)) == 2


def test_a_flipped_or_replayed_update_raises_their_loss(setting):
    mine, theta0, base = setting
    seed = derive_seed("t", 2, "p")
    own = training_check.own_batches(mine, CONFIG.seq_len, 8, seed, steps=12)
    _, delta = _train(base, mine, seed)
    assert training_check.untrained(training_check.own_gain(CONFIG, base, -10.0 * delta, own))
    # The producer's update of an earlier round (from the first weights, on its batches then), sent again now.
    _, replayed = _train(theta0, mine, derive_seed("t", 0, "p"))
    gain = training_check.own_gain(CONFIG, base, replayed, own)
    assert training_check.untrained(gain), gain


def test_a_proof_needs_the_accuser_below_and_a_confirmer_within_the_tolerance():
    t, tol = training_check.UNTRAINED_GAIN, training_check.TOLERANCE
    assert training_check.untrained(t - 2 * tol) and training_check.confirms(t - 2 * tol)
    assert not training_check.untrained(t) and training_check.confirms(t)
    assert not training_check.untrained(t + 2 * tol) and not training_check.confirms(t + 2 * tol)
    with pytest.raises(ValueError, match="does not fit"):
        training_check.own_gain(CONFIG, named_tensors(init_model(CONFIG, 0)), torch.zeros(3), [])


def test_the_trainer_child_measures_what_the_function_gives_and_refuses_what_does_not_fit(setting, tmp_path):
    # The daemon asks its trainer child for these measures (node/tasks/checks.py): the child must give the very
    # figures node/train/check.py gives in-process, its own gain and its advantage over a near copy's owner.
    import dataclasses

    import trio

    from node.train import check
    from node.train.client import TrainerRequestFailed, open_trainer
    from node.train.diloco import save_named, unflatten

    mine, _, base = setting
    corpus = tmp_path / "corpus"
    corpus.write_bytes(mine)
    half = len(mine) // 2
    seeds = {"p": derive_seed("t", 1, "p"), "q": derive_seed("t", 1, "q")}
    _, delta = _train(base, mine[:half], seeds["p"])
    _, reference = _train(base, mine[half:], seeds["q"])
    layout = flatten(base)[1]
    save_named(tmp_path / "base.safetensors", base)
    save_named(tmp_path / "delta.safetensors", unflatten(delta, layout))
    save_named(tmp_path / "reference.safetensors", unflatten(reference, layout))
    wanted = {"p": {"shard_ranges": [[0, half]], "seed": seeds["p"], "steps": 12},
              "q": {"shard_ranges": [[half, len(mine)]], "seed": seeds["q"], "steps": 12}}
    drawn = check.draw(corpus, CONFIG.seq_len, 8, wanted, "p", ["p", "q"])
    expected = check.measure(CONFIG, base, delta, reference, drawn, "p", ["p", "q"])
    assert expected["p"] > 0 and expected["q"] > 0, expected  # an honest update fits its own batches better
    req = {"model": dataclasses.asdict(CONFIG), "base_path": str(tmp_path / "base.safetensors"),
           "delta_path": str(tmp_path / "delta.safetensors"), "reference_path": str(tmp_path / "reference.safetensors"),
           "data_path": str(corpus), "producer": "p", "owners": ["p", "q"], "batches": wanted, "batch_size": 8}

    async def main():
        async with open_trainer() as trainer:
            assert (await trainer.request("gain", **req))["gains"] == expected
            save_named(tmp_path / "short.safetensors", dict(list(unflatten(delta, layout).items())[:-1]))
            with pytest.raises(TrainerRequestFailed, match="does not fit"):
                await trainer.request("gain", **{**req, "delta_path": str(tmp_path / "short.safetensors")})
            with pytest.raises(TrainerRequestFailed, match="need their batches"):
                await trainer.request("gain", **{**req, "owners": ["p", "r"]})
            await trainer.ping()  # still serving

    trio.run(main)
