"""The multi-device inner loop: two gloo processes under DDP give the same update as one process on the same samples."""

import pytest
import torch

from node.train.data import build_corpus
from node.train.ddp import train_inner_ddp
from node.train.diloco import named_tensors
from node.train.inner import AdamWConfig, train_inner
from node.train.model import ModelConfig, init_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_two_gloo_processes_match_one_process_on_the_same_batches():
    config = ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=16)
    base = named_tensors(init_model(config, seed=3))
    data = build_corpus(64 * 1024)
    adamw = AdamWConfig(lr=3e-3, weight_decay=0.0)
    one = train_inner(model_config=config, base_weights=base, data=data, steps=6, batch_size=8, seed=11,
                      adamw=adamw).weights
    two = train_inner_ddp(world_size=2, model_config=config, base_weights=base, data=data, steps=6, batch_size=8,
                          seed=11, adamw=adamw, backend="gloo")
    assert one.keys() == two.keys()
    moved = max(float((one[n] - base[n]).abs().max()) for n in one)
    diff = max(float((one[n] - two[n]).abs().max()) for n in one)
    assert moved > 1e-3, "training did not move the weights"
    assert diff < 1e-5 * max(1.0, moved) + 1e-6, (diff, moved)
    # A different split of the data (one rank alone on half the rows) would not match: the check can fail.
    half = train_inner(model_config=config, base_weights=base, data=data, steps=6, batch_size=4, seed=11,
                       adamw=adamw).weights
    assert max(float((half[n] - two[n]).abs().max()) for n in half) > 10 * diff
    torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-4)
