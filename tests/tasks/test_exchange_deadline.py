"""An aggregator combines what arrived in time: one producer that died after announcing costs only its slice."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import trio

from node.tasks import exchange as exchange_module
from node.tasks.exchange import AGGREGATE_FETCH_SHARE, Exchange
from protocol.task import UpdateAnnounce
from protocol.task_machine import Aggregate
from tests.tasks.conftest import tiny_spec

TASK = "ab" * 32


def own_values(seed: str, numel: int, mean: float) -> torch.Tensor:
    """A slice of its own (no two alike, so the screen leaves none out) around ``mean``."""
    return mean + 0.5 * torch.randn(numel, generator=torch.Generator().manual_seed(sum(map(ord, seed))))


def offline_exchange(tmp_path, spec, numel: int) -> Exchange:
    """An Exchange with no store or network: the tests stub its fetches and publications."""
    return Exchange(shardcast=None, spec=spec, task_id=TASK, directory=tmp_path, keypair=SimpleNamespace(peer_id="me"),
                    penalize=lambda peer, why: None, num_params=lambda: numel * spec.aggregation_shards)


async def test_a_producer_that_never_serves_its_slice_leaves_the_aggregate_in_time(tmp_path, autojump_clock,
                                                                                   monkeypatch):
    spec = tiny_spec()
    numel = 1000
    exchange = offline_exchange(tmp_path, spec, numel)

    async def fetch_payload(manifest_hex, signer, numel_, timeout_s, *, kept, round_, codec=None):
        with trio.fail_after(timeout_s):  # as Exchange._fetch bounds every fetch
            if signer == "dead":
                await trio.sleep_forever()  # SIGKILLed right after it announced its update
            data = exchange.codec.encode(own_values(signer, numel_, 0.5))
            return None, torch.frombuffer(bytearray(data), dtype=torch.uint8)

    async def publish_payload(data, label):
        return SimpleNamespace(label=label)

    exchange._fetch_payload, exchange._publish_payload = fetch_payload, publish_payload
    monkeypatch.setattr(exchange_module, "manifest_id", lambda m: bytes.fromhex("cd" * 32))
    monkeypatch.setattr(exchange_module, "payload_hash", lambda m, data: "ef" * 32)
    updates = tuple(UpdateAnnounce(task_id=TASK, round=4, producer=p, base_hash="ef" * 32, samples=8,
                                   manifest_ids=("01" * 32, "02" * 32), losses=()) for p in ("a", "b", "dead"))
    started = trio.current_time()
    result = await exchange.aggregate(Aggregate(4, 0, updates))
    took_s = trio.current_time() - started
    assert result is not None and result.included == ("a", "b")
    # Published well before the members' gathering deadline (one round deadline after collection).
    assert took_s <= AGGREGATE_FETCH_SHARE * spec.round_deadline_s + 1 < spec.round_deadline_s


async def test_a_recomputation_matches_the_aggregate_and_refuses_a_slice_that_is_not_the_producers(tmp_path,
                                                                                                   monkeypatch):
    import hashlib

    from node.tasks import compute
    from protocol.audit import UNDECODABLE, Input, Verify
    from protocol.errors import IntegrityError

    spec = tiny_spec()
    numel = 1000
    exchange = offline_exchange(tmp_path, spec, numel)
    label = f"task/{TASK[:12]}/r4/u0"
    slices = {"01" * 32: ("a", label, 0.5), "02" * 32: ("b", label, -0.25), "03" * 32: ("b", label, 0.75),
              "04" * 32: ("b", f"task/{TASK[:12]}/r3/u0", -0.25)}

    async def fetch_payload(manifest_hex, signer, numel_, timeout_s, *, kept, round_, codec=None):
        producer, its_label, value = slices[manifest_hex]
        if producer != signer:
            raise IntegrityError(f"manifest {manifest_hex[:16]} is not signed by {signer}")
        data = exchange.codec.encode(own_values(manifest_hex, numel_, value))
        return SimpleNamespace(label=its_label), torch.frombuffer(bytearray(data), dtype=torch.uint8)

    async def publish_payload(data, label_):
        return SimpleNamespace(label=label_)

    def sha(m, data):
        return hashlib.sha256(compute.tensor_bytes(data) if hasattr(data, "data_ptr") else bytes(data)).hexdigest()

    exchange._fetch_payload, exchange._publish_payload = fetch_payload, publish_payload
    monkeypatch.setattr(exchange_module, "manifest_id", lambda m: bytes.fromhex("cd" * 32))
    monkeypatch.setattr(exchange_module, "payload_hash", sha)
    updates = tuple(UpdateAnnounce(task_id=TASK, round=4, producer=p, base_hash="ef" * 32, samples=8,
                                   manifest_ids=(m, "09" * 32), losses=()) for p, m in (("a", "01" * 32), ("b", "02" * 32)))
    made = await exchange.aggregate(Aggregate(4, 0, updates))
    assert made.inputs == ("01" * 32, "02" * 32)
    key = (4, 0, made.included, made.inputs)

    async def recomputed(*inputs):
        return (await exchange.verify(Verify(4, 0, tuple(Input(p, m, 8) for p, m in inputs), key))).result_hash

    assert await recomputed(("a", "01" * 32), ("b", "02" * 32)) == made.result_hash
    # b's other slice of this round (a restarted b signed it): checkable, and another result.
    assert await recomputed(("a", "01" * 32), ("b", "03" * 32)) not in (made.result_hash, UNDECODABLE, None)
    assert await recomputed(("a", "01" * 32), ("b", "04" * 32)) == UNDECODABLE  # b's slice of round 3
    assert await recomputed(("a", "02" * 32), ("b", "02" * 32)) == UNDECODABLE  # b's slice passed off as a's
