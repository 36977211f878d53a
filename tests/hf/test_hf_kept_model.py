"""The trainer child keeps one built hf model between requests (node/train/hf.py ``built``): a round's train, eval
and gain requests give exactly what each gives on a freshly loaded model, and the model is loaded once."""

import pytest
import torch

from node.dataset import encode_records
from node.train import hf, recipes
from node.train.diloco import load_named, save_named


def _records(recipe: str) -> list[dict]:
    if recipe == "hf-dpo":
        return [{"prompt": f"q{i}: what is {i} plus {i}?", "chosen": f" it is {2 * i}.",
                 "rejected": f" maybe {i + 7}, or not."} for i in range(24)]
    return [{"text": f"record {i}: ada has {i} red keys and gives {i % 3} away."} for i in range(40)]


def _round(tmp_path, req: dict, fresh: bool) -> dict:
    """Train, evaluate the trained weights, measure the update's gain, train again from them: each on a newly
    loaded model when ``fresh``."""
    out = {}

    def call(name, fn, r):
        if fresh:
            hf._built.clear()
        out[name] = fn(r, device="cpu")

    call("train", lambda r, device: recipes.train(r, device=device, progress=lambda *_: None),
         {**req, "out_path": str(tmp_path / "delta1.safetensors")})
    base, delta = load_named(req["base_path"]), load_named(tmp_path / "delta1.safetensors")
    save_named(tmp_path / "next.safetensors", {n: base[n] - delta[n] for n in base})
    # The round's weights, not the trained ones the kept model was left holding.
    call("eval", recipes.evaluate, {**req, "weights_path": req["base_path"],
                                    "data_range": [0, 12], "num_batches": 2})
    call("gain", recipes.gain, {**req, "delta_path": str(tmp_path / "delta1.safetensors"), "count": 2})
    call("again", lambda r, device: recipes.train(r, device=device, progress=lambda *_: None),
         {**req, "base_path": str(tmp_path / "next.safetensors"), "out_path": str(tmp_path / "delta2.safetensors")})
    out["deltas"] = [load_named(tmp_path / f"delta{i}.safetensors") for i in (1, 2)]
    for name in ("train", "again"):
        out[name].pop("seconds")
    return out


@pytest.mark.parametrize("recipe, method", [("hf-causal-lm", "lora"), ("hf-causal-lm", "full"), ("hf-dpo", "lora")])
def test_a_kept_model_answers_as_a_freshly_loaded_one_and_is_loaded_once(tiny_llama, tmp_path, monkeypatch, recipe,
                                                                         method):
    (tmp_path / "records").write_bytes(encode_records(_records(recipe)))
    model = {"recipe": recipe, "model_dir": str(tiny_llama), "method": method, "seq_len": 16}
    recipes.prepare({"model": model, "data_path": str(tmp_path / "records"), "seed": 5,
                     "out_path": str(tmp_path / "base.safetensors")})
    req = {"model": model, "base_path": str(tmp_path / "base.safetensors"), "data_path": str(tmp_path / "records"),
           "shard_ranges": [[0, 24]], "steps": 3, "batch_size": 4, "seed": 9,
           "adamw": {"lr": 1e-2 if method == "lora" else 1e-3, "weight_decay": 0.0}, "log_every": 1}
    fresh = _round(tmp_path, req, fresh=True)
    loads = []
    build = hf.build
    monkeypatch.setattr(hf, "build", lambda *a, **k: loads.append(a) or build(*a, **k))
    hf._built.clear()
    kept = _round(tmp_path, req, fresh=False)
    assert len(loads) == 1
    for name in ("train", "eval", "gain", "again"):
        assert kept[name] == fresh[name], name
    for a, b in zip(kept["deltas"], fresh["deltas"]):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # Another model directory, or the same one changed, is loaded anew.
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_llama.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    recipes.gain({**req, "model": {**model, "model_dir": str(other)}, "delta_path": str(tmp_path / "delta1.safetensors"),
                  "count": 1}, device="cpu")
    assert len(loads) == 2 and len(hf._built) == 1
    hf._built.clear()
