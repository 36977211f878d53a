"""The outer step: pseudo-gradients, weighted mean, Nesterov, hashing and files, all bit-stable."""

import itertools

import pytest
import torch

from node.train.diloco import (
    OuterNesterov, flatten, load_named, pseudo_gradient, save_named, unflatten, weighted_mean,
    weighted_mean_by_peer, weights_hash,
)


def rand(seed, shape=(5, 3)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_outer_nesterov_matches_a_hand_computation():
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    p = {"w": torch.tensor([1.0])}
    p = outer.step(p, {"w": torch.tensor([0.1])})  # buf 0.1, d = 0.1 + 0.09
    assert p["w"].item() == pytest.approx(1.0 - 0.7 * 0.19, abs=1e-7)
    p = outer.step(p, {"w": torch.tensor([0.2])})  # buf 0.29, d = 0.2 + 0.261
    assert p["w"].item() == pytest.approx(0.867 - 0.7 * 0.461, abs=1e-6)


def test_outer_nesterov_agrees_with_torch_sgd():
    w = torch.nn.Parameter(rand(0))
    sgd = torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterNesterov()
    ours = {"w": rand(0)}
    for seed in range(1, 5):
        w.grad = rand(seed)
        sgd.step()
        ours = outer.step(ours, {"w": rand(seed)})
    assert torch.allclose(ours["w"], w.detach(), atol=1e-6)


def test_outer_state_round_trips_through_a_file(tmp_path):
    a = OuterNesterov()
    params = {"w": rand(0), "b": rand(1, (3,))}
    params = a.step(params, {"w": rand(2), "b": rand(3, (3,))})
    save_named(tmp_path / "outer.safetensors", a.state_dict())
    b = OuterNesterov()
    b.load_state_dict(load_named(tmp_path / "outer.safetensors"))
    update = {"w": rand(4), "b": rand(5, (3,))}
    assert weights_hash(a.step(params, update)) == weights_hash(b.step(params, update))


def test_weighted_mean_value_and_order_independence():
    updates = {f"peer-{i}": ({"w": rand(i), "v": rand(10 + i, (2,))}, float(i + 1)) for i in range(4)}
    expected = sum(u["w"] * w for u, w in updates.values()) / 10.0
    hashes = set()
    for perm in itertools.permutations(updates):
        got = weighted_mean_by_peer({peer: updates[peer] for peer in perm})
        hashes.add(weights_hash(got))
    assert len(hashes) == 1
    assert torch.allclose(got["w"], expected, atol=1e-6)
    with pytest.raises(ValueError):
        weighted_mean([({"w": rand(0)}, 0.0)])
    with pytest.raises(ValueError):
        weighted_mean([({"w": rand(0)}, 1.0), ({"x": rand(0)}, 1.0)])


def test_two_nodes_reach_the_same_bits_from_the_same_payloads():
    from node.train.compress import decode_int8, encode_int8

    theta = {"w": rand(0, (300,))}
    payloads = {f"peer-{i}": (encode_int8(rand(10 + i, (300,)) * 0.01), 100 + i) for i in range(3)}

    def node(order):
        outer = OuterNesterov()
        updates = {p: ({"w": decode_int8(payloads[p][0], 300)}, payloads[p][1]) for p in order}
        params = theta
        for _ in range(2):
            params = outer.step(params, weighted_mean_by_peer(updates))
        return weights_hash(params)

    assert node(["peer-0", "peer-1", "peer-2"]) == node(["peer-2", "peer-0", "peer-1"])


def test_pseudo_gradient_and_flatten_round_trip():
    base = {"b": rand(0, (4,)), "a": rand(1)}
    trained = {"a": rand(2), "b": rand(3, (4,))}
    delta = pseudo_gradient(base, trained)
    assert list(delta) == ["a", "b"] and torch.equal(delta["a"], base["a"] - trained["a"])
    flat, layout = flatten(delta)
    assert flat.shape == (19,) and [n for n, _ in layout] == ["a", "b"]
    assert weights_hash(unflatten(flat, layout)) == weights_hash(delta)
    with pytest.raises(ValueError):
        unflatten(flat[:-1], layout)
    with pytest.raises(ValueError):
        pseudo_gradient(base, {"a": rand(2)})


def test_weights_hash_is_stable():
    named = {"b": torch.arange(6, dtype=torch.float32).view(2, 3), "a": torch.zeros(2)}
    assert weights_hash(named) == weights_hash(dict(reversed(list(named.items()))))
    # Pinned so any change to the hash's byte format shows up here, not between nodes.
    assert weights_hash(named) == PINNED
    assert weights_hash({**named, "a": torch.tensor([0.0, 1e-30])}) != PINNED
    assert weights_hash({**named, "a": torch.zeros(1, 2)}) != PINNED


PINNED = "700148ceffe9c36241b8eadfc50e3f668ed2f9299f31a054e23cf704f43b704b"


def test_save_is_atomic_and_loads_back(tmp_path):
    named = {"w": rand(0), "i": torch.arange(4, dtype=torch.int8)}
    path = tmp_path / "x.safetensors"
    save_named(path, named, metadata={"round": "3"})
    save_named(path, named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]
    back = load_named(path)
    assert list(back) == ["i", "w"] and weights_hash(back) == weights_hash(named)
