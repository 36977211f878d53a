"""A task checkpoint survives a process killed at any point of its save: the old or the new one loads whole."""

from __future__ import annotations

import os

import pytest
import torch

from node.tasks import compute, task_files
from tests.tasks.conftest import tiny_spec


def states():
    spec = tiny_spec()
    old = compute.new_state(spec)
    weights = {n: t + 0.5 for n, t in old.weights.items()}
    new = compute.OuterState(round=1, weights=weights, outer=old.outer, work=3)
    return spec, old, new


class Killed(BaseException):
    """The process died here."""


@pytest.mark.parametrize("dies_before", ["momentum.safetensors", "meta.json", "end"])
def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path, monkeypatch, dies_before):
    spec, old, new = states()
    task_files.save_checkpoint(tmp_path, old)
    real_save, real_write, real_replace = task_files.save_named, task_files.write_atomic, os.replace

    def check(path):
        if os.path.basename(path) == dies_before:
            raise Killed

    monkeypatch.setattr(task_files, "save_named", lambda path, named, **kw: (check(path), real_save(path, named, **kw)))
    monkeypatch.setattr(task_files, "write_atomic", lambda path, data: (check(path), real_write(path, data)))
    monkeypatch.setattr(task_files.os, "replace", lambda a, b: (check(b), real_replace(a, b)))
    try:
        task_files.save_checkpoint(tmp_path, new)
    except Killed:
        pass
    monkeypatch.undo()
    loaded = task_files.load_checkpoint(tmp_path, spec)
    assert loaded is not None, sorted(p.name for p in tmp_path.iterdir())
    committed = dies_before == "end"
    want = new if committed else old
    assert (loaded.round, loaded.weights_hash(), loaded.state_hash()) == (want.round, want.weights_hash(),
                                                                         want.state_hash())
    # What the trainer reads is the checkpoint's own weights.
    on_disk = task_files.load_named(tmp_path / "weights.safetensors")
    assert all(torch.equal(on_disk[n], want.weights[n]) for n in want.weights)


def test_a_checkpoint_that_does_not_verify_does_not_load(tmp_path):
    spec, old, _ = states()
    task_files.save_checkpoint(tmp_path, old)
    (tmp_path / "meta.json").write_text('{"round": 0, "weights_hash": "00", "state_hash": "00"}')
    assert task_files.load_checkpoint(tmp_path, spec) is None
