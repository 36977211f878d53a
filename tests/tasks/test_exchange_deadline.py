"""An aggregator combines what arrived in time: one producer that died after announcing costs only its slice."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import trio

from node.tasks import exchange as exchange_module
from node.tasks.exchange import AGGREGATE_FETCH_SHARE, Exchange
from node.train.compress import encode_int8
from protocol.task import UpdateAnnounce
from protocol.task_machine import Aggregate
from tests.tasks.conftest import tiny_spec

TASK = "ab" * 32


async def test_a_producer_that_never_serves_its_slice_leaves_the_aggregate_in_time(tmp_path, autojump_clock,
                                                                                   monkeypatch):
    spec = tiny_spec()
    numel = 1000
    exchange = Exchange(shardcast=None, spec=spec, task_id=TASK, directory=tmp_path,
                        keypair=SimpleNamespace(peer_id="me"), penalize=lambda peer, why: None,
                        num_params=lambda: numel * spec.aggregation_shards)

    async def fetch_payload(manifest_hex, signer, numel_, timeout_s, *, kept, round_, bits=8):
        with trio.fail_after(timeout_s):  # as Exchange._fetch bounds every fetch
            if signer == "dead":
                await trio.sleep_forever()  # SIGKILLed right after it announced its update
            data = encode_int8(torch.full((numel_,), 0.5))
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
