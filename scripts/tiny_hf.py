"""Tiny random-initialised transformers models (Llama, GPT-2, Qwen2), a locally trained tokenizer, and toy data."""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["ada", "bo", "cy", "di", "ed", "flo", "gus", "hal"]
THINGS = ["apples", "books", "cats", "drums", "eggs", "figs", "gems", "hats"]
COLORS = ["red", "blue", "green", "gold", "gray", "pink"]
SPECIAL = ["<unk>", "<s>", "</s>"]


def text_records(num: int, seed: int = 0) -> list[dict]:
    """Sentences with structure a tiny model can learn in a few hundred steps (held-out loss then falls)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        name, thing, color = rng.choice(NAMES), rng.choice(THINGS), rng.choice(COLORS)
        n = rng.randint(2, 9)
        out.append({"text": f"{name} has {n} {color} {thing}. {name} gives {n - 1} {thing} away and keeps one."})
    return out


def pair_records(num: int, seed: int = 0) -> list[dict]:
    """Preference pairs: the chosen answer is the right count, the rejected one is off by one."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        n = rng.randint(2, 8)
        out.append({"prompt": f"{name} has {n} {thing} and gets one more. now {name} has",
                    "chosen": f" {n + 1} {thing}.", "rejected": f" {n - 1} {thing}."})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train_tokenizer(texts: list[str], vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def make_model_dir(out: Path, *, arch: str = "llama", seed: int = 0, hidden: int = 32, layers: int = 2,
                   vocab_size: int | None = None, texts: list[str] | None = None) -> Path:
    """A random-initialised causal LM and its tokenizer in ``out``, as save_pretrained writes them."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    texts = texts or [r["text"] for r in text_records(400)] + [
        r["prompt"] + r["chosen"] + r["rejected"] for r in pair_records(200)]
    tok = train_tokenizer(texts)
    vocab = vocab_size or tok.get_vocab_size()
    ids = {"bos_token_id": 1, "eos_token_id": 2}
    if arch == "llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                             max_position_embeddings=256, **ids)
    elif arch == "qwen2":
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=256, **ids)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=2, n_positions=256, **ids)
    else:
        raise ValueError(f"arch must be llama, qwen2 or gpt2, not {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(out)
    return out
