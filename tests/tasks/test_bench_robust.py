"""bench_robust on a tiny bounded slice: a sign-flipping attacker ruins the plain mean, not the median."""

from __future__ import annotations

import dataclasses

import pytest

from node.train.model import ModelConfig
from protocol.task import AggregationSpec
from scripts.bench_robust import RULES, Bench, Excluded, choose, run_one

pytestmark = pytest.mark.timeout(120)

TINY = Bench(model=ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=32), rounds=3, inner_steps=4, batch_size=4,
             pretrain_steps=0, num_shards=8, eval_batches=4, corpus_bytes=96 * 1024)


def test_a_sign_flipper_moves_the_mean_and_not_the_median():
    def loss(rule, attack):
        return run_one(TINY, rule, attack, producers=4, attackers=1, seed=0)
    mean, median = AggregationSpec(), AggregationSpec(rule="median", norm_bound=2.0)
    clean_mean, clean_median = loss(mean, "clean"), loss(median, "clean")
    flipped_mean, flipped_median = loss(mean, "sign_flip_x10"), loss(median, "sign_flip_x10")
    assert flipped_mean is None or flipped_mean > clean_mean * 1.2
    assert abs(flipped_median - clean_median) < 0.05 * clean_median  # 3-4% in the full bench at 25% attackers
    assert abs(clean_median - clean_mean) < 0.05 * clean_mean


def _entry(clean_vs_mean, **attacks):
    return {"clean_vs_mean_pct": clean_vs_mean, "attacks": {"clean": {"vs_clean_pct": 0.0},
                                                            **{k: {"vs_clean_pct": v} for k, v in attacks.items()}}}


def test_choose_takes_the_smallest_worst_case_among_rules_cheap_for_honest_training():
    results = {"4x1": {name: _entry(0.0, zeros=0.1) for name in RULES}}
    results["4x1"]["mean"] = _entry(0.0, zeros=0.0, sign_flip_x10=None)  # diverged
    results["4x1"]["median"] = _entry(0.5, zeros=0.05)
    results["4x1"]["centered_clip"] = _entry(3.0, zeros=0.0)  # robust, but too costly when nobody attacks
    assert choose(results)[0] == "median"


def test_the_training_checks_leave_a_replaying_producer_out_and_no_honest_one():
    bench = dataclasses.replace(TINY, rounds=6, inner_steps=12)
    rule = RULES["centered_clip+screen+checks"]
    for attack, caught in (("stale", True), ("clean", False)):
        excluded = Excluded()
        assert run_one(bench, rule, attack, producers=4, attackers=1, seed=0, excluded=excluded, checks=True)
        assert excluded.honest == 0
        assert (excluded.malicious > 0) is caught, excluded
