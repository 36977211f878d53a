"""TinyLM: shapes, gradients, seeded init and config validation."""

import pytest
import torch

from node.train.diloco import named_tensors, weights_hash
from node.train.model import ModelConfig, init_model

TINY = ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=16)


def test_forward_backward_shapes():
    model = init_model(TINY, seed=0)
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256)
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_causal_prefix_does_not_see_the_future():
    model = init_model(TINY, seed=0).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    assert torch.allclose(model(idx)[0, :-1], model(changed)[0, :-1])


def test_init_is_fixed_by_the_seed_alone():
    torch.manual_seed(123)
    a = weights_hash(named_tensors(init_model(TINY, seed=5)))
    torch.manual_seed(456)
    assert a == weights_hash(named_tensors(init_model(TINY, seed=5)))
    assert a != weights_hash(named_tensors(init_model(TINY, seed=6)))


@pytest.mark.parametrize("fields", [
    dict(n_layer=1, n_head=3, d_model=16, seq_len=16),
    dict(n_layer=0, n_head=2, d_model=16, seq_len=16),
    dict(n_layer=1000, n_head=2, d_model=16, seq_len=16),
    dict(n_layer=1, n_head=2, d_model=16, seq_len=16, dropout=1.5),
    dict(n_layer=1, n_head=2, d_model=16, seq_len=16, width=3),
])
def test_absurd_configs_are_value_errors(fields):
    with pytest.raises(ValueError):
        ModelConfig.from_dict(fields)


def test_too_long_input_is_refused():
    with pytest.raises(ValueError, match="seq_len"):
        init_model(TINY, seed=0)(torch.zeros(1, 17, dtype=torch.long))
