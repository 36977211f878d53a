"""The training check's measure for hf-causal-lm updates (node/train/recipes.py ``gain``): an update trained on a
producer's batches lowers their loss, one sent again from an earlier round or made up raises it past
UNTRAINED_GAIN_HF, and the trainer child answers the daemon's request with the same figure the function gives
in-process."""

import pytest
import torch
import trio

from node.dataset import encode_records
from node.tasks import training_check
from node.train import hf, recipes
from node.train.client import TrainerRequestFailed, open_trainer
from node.train.diloco import pseudo_gradient, save_named
from node.train.inner import AdamWConfig
from scripts.tiny_hf import text_records

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """A LoRA update of 12 steps from θ_0 on a producer's records, the next round's update from θ_1 (θ_0 with the
    first applied), and what measures an update on the second round's batches from θ_1."""
    work = tmp_path_factory.mktemp("gain")
    data = work / "records.bin"
    data.write_bytes(encode_records(text_records(120, seed=5)))
    config = hf.HFConfig(recipe="hf-causal-lm", model_dir=str(tiny_llama), method="lora", seq_len=48,
                         target_modules=tuple(TARGETS))
    model, trainable = hf.build(config)
    adamw = AdamWConfig(lr=3e-2, weight_decay=0.0, beta2=0.95, warmup_steps=0)

    def train(theta: dict, seed: int, opt_state) -> tuple[dict, dict]:
        hf.load_trainable(trainable, theta)
        recs = hf.records(str(data))[0:60]
        out = hf.run_inner(trainable=trainable, loss_of=hf.causal_loss_fn(config, model, recs, 8, seed, "cpu"),
                           steps=12, adamw=adamw, seed=seed, batch_size=8, opt_state=opt_state, time_budget_s=None,
                           log_every=12, progress=lambda *_: None)
        return pseudo_gradient(theta, out["weights"]), out["opt_state"]

    theta0 = hf.initial_trainable(config, 1)
    first, opt = train(theta0, 7, None)
    theta1 = {n: theta0[n] - first[n] for n in theta0}
    second, _ = train(theta1, 8, opt)
    save_named(work / "base.safetensors", theta1)
    req = {"model": {"recipe": "hf-causal-lm", "model_dir": str(tiny_llama), "method": "lora", "seq_len": 48,
                     "target_modules": TARGETS},
           "base_path": str(work / "base.safetensors"), "data_path": str(data), "shard_ranges": [[0, 60]],
           "seed": 8, "batch_size": 8, "count": training_check.CHECK_BATCHES}

    def gain_of(update: dict, name: str, **over) -> float:
        path = work / f"{name}.safetensors"
        save_named(path, update)
        return recipes.gain({**req, "delta_path": str(path), **over}, device="cpu")["gain"]

    return {"first": first, "second": second}, req, gain_of, work


def test_an_update_trained_on_the_batches_gains_and_a_stale_or_made_up_one_is_untrained(trained):
    updates, _, gain_of, _ = trained
    threshold = training_check.UNTRAINED_GAIN_HF["lora"]
    honest = gain_of(updates["second"], "honest")
    assert honest > 0 and not training_check.untrained(honest, threshold), honest
    # The first round's update sent again: it moves θ_1 on past where its batches wanted it.
    stale = gain_of(updates["first"], "stale")
    assert training_check.untrained(stale, threshold), stale
    norm = torch.sqrt(sum((t ** 2).sum() for t in updates["second"].values()))
    gen = torch.Generator().manual_seed(0)
    noise = {n: torch.randn(t.shape, generator=gen) for n, t in updates["second"].items()}
    scale = norm / torch.sqrt(sum((t ** 2).sum() for t in noise.values()))
    made_up = gain_of({n: t * scale * 3 for n, t in noise.items()}, "noise")
    assert training_check.untrained(made_up, threshold), made_up
    # The first batches its producer drew: the same update measured on another seed's batches gains otherwise.
    assert gain_of(updates["second"], "elsewhere", seed=9) != honest


def test_the_trainer_child_measures_the_same_gain_and_refuses_what_does_not_fit(trained):
    updates, req, gain_of, work = trained
    delta = updates["second"]
    expected = gain_of(delta, "child")

    async def main():
        async with open_trainer() as trainer:
            reply = await trainer.request("gain", **{**req, "delta_path": str(work / "child.safetensors"),
                                                     "device": "cpu"})
            assert reply["gain"] == expected
            save_named(work / "short.safetensors", dict(list(delta.items())[:-1]))
            with pytest.raises(TrainerRequestFailed, match="do not match"):
                await trainer.request("gain", **{**req, "delta_path": str(work / "short.safetensors")})
            # Not an hf model: measured as tiny-lm's (node/train/check.py), which this one does not describe.
            with pytest.raises(TrainerRequestFailed, match="n_head"):
                await trainer.request("gain", **{**req, "model": {"n_layer": 1}})
            await trainer.ping()  # still serving

    trio.run(main)
