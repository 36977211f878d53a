"""Tiny transformers models for the hf tests, made once per session (a tokenizer trained here, random weights)."""

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from scripts.tiny_hf import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", seed=0)
