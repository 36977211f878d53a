"""An aggregator leaves zeros and copies out of what it lists and says which it left out and why; a
recomputation that finds one listed, or a screen claim the slices do not bear out, calls the aggregate
forged: no honest aggregator makes either. Nobody is charged here: every node charges the screened producers
of the aggregates it applies (the task machine's ScreenedOut)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch
import trio

from node.tasks import compute
from node.tasks import exchange as exchange_module
from protocol.audit import UNDECODABLE, Input, Verify
from protocol.task import UpdateAnnounce
from protocol.task_machine import Aggregate
from tests.tasks.conftest import tiny_spec
from tests.tasks.test_exchange_deadline import TASK, offline_exchange, own_values

NUMEL = 1000


def wired(tmp_path, monkeypatch, values: dict[str, torch.Tensor]):
    """An offline Exchange whose producers serve ``values`` (manifest id -> slice), labelled for round 4, slice 0."""
    charged: list[tuple[str, str]] = []
    exchange = offline_exchange(tmp_path, tiny_spec(), NUMEL)
    exchange.penalize = lambda peer, why: charged.append((peer, why))

    async def fetch_payload(manifest_hex, signer, numel_, timeout_s, *, kept, round_, codec=None):
        data = exchange.codec.encode(values[manifest_hex])
        return SimpleNamespace(label=f"task/{TASK[:12]}/r4/u0"), torch.frombuffer(bytearray(data), dtype=torch.uint8)

    async def publish_payload(data, label):
        return SimpleNamespace(label=label)

    exchange._fetch_payload, exchange._publish_payload = fetch_payload, publish_payload
    monkeypatch.setattr(exchange_module, "manifest_id", lambda m: bytes.fromhex("cd" * 32))
    monkeypatch.setattr(exchange_module, "payload_hash", lambda m, data: hashlib.sha256(
        compute.tensor_bytes(data) if hasattr(data, "data_ptr") else bytes(data)).hexdigest())
    return exchange, charged


def updates(*producers: str) -> tuple[UpdateAnnounce, ...]:
    return tuple(UpdateAnnounce(task_id=TASK, round=4, producer=p, base_hash="ef" * 32, samples=8,
                                manifest_ids=(mid(p), "09" * 32), losses=()) for p in producers)


def mid(producer: str) -> str:
    return hashlib.sha256(producer.encode()).hexdigest()


async def recomputed(exchange, *producers, screened: dict[str, str] | None = None) -> str | None:
    screened = screened or {}
    key = (4, 0, producers, tuple(mid(p) for p in producers), tuple(sorted(screened)))
    job = Verify(4, 0, tuple(Input(p, mid(p), 8) for p in producers), key,
                 tuple((Input(p, mid(p), None), why) for p, why in sorted(screened.items())))
    return (await exchange.verify(job)).result_hash


async def test_zeros_and_a_copy_are_left_out_announced_and_checkable(tmp_path, monkeypatch):
    values = {mid(p): own_values(p, NUMEL, 0.5) for p in ("a", "b", "c", "d")}
    values[mid("zeros")] = torch.zeros(NUMEL)
    values[mid("copier")] = values[mid("c")] + 0.01 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    exchange, charged = wired(tmp_path, monkeypatch, values)
    made = await exchange.aggregate(Aggregate(4, 0, updates("a", "b", "c", "d", "zeros", "copier")))
    assert made.included == ("a", "b", "d") and made.inputs == (mid("a"), mid("b"), mid("d"))
    assert made.screened == ("c", "copier", "zeros") and made.screened_why == ("duplicate", "duplicate", "empty")
    assert made.screened_inputs == (mid("c"), mid("copier"), mid("zeros"))
    assert charged == [] and dict(exchange.screened) == {"empty": 1, "duplicate": 2}

    claim = dict(zip(made.screened, made.screened_why))
    assert await recomputed(exchange, "a", "b", "d", screened=claim) == made.result_hash
    # Left out without a word, they make the same result: an aggregate that decided on fewer producers.
    assert await recomputed(exchange, "a", "b", "d") == made.result_hash
    # A screen claim the slices do not bear out is a proof: an honest producer called a copy or empty,
    # a copy called empty, or a screened slice left unmentioned beside the one it copies.
    assert await recomputed(exchange, "a", "b", screened={**claim, "d": "opposed"}) == UNDECODABLE
    assert await recomputed(exchange, "a", "b", "d", screened={**claim, "zeros": "opposed"}) == UNDECODABLE
    assert await recomputed(exchange, "a", "b", "d", screened={"c": "duplicate", "zeros": "empty"}) == UNDECODABLE
    # An aggregator that lists the zeros, or both copies, made an aggregate no honest one makes: a proof.
    assert await recomputed(exchange, "a", "b", "d", "zeros") == UNDECODABLE
    assert await recomputed(exchange, "a", "b", "c", "copier", "d") == UNDECODABLE
    # A copy whose original it did not list is no copy within what it lists: its result stands on its own.
    assert await recomputed(exchange, "a", "b", "copier", "d") not in (UNDECODABLE, None, made.result_hash)


async def test_a_slice_whose_every_update_is_screened_out_has_no_aggregate_and_no_one_is_called_corrupt(
        tmp_path, monkeypatch):
    values = {mid("a"): own_values("a", NUMEL, 0.1)}
    values[mid("copier")] = values[mid("a")].clone()
    exchange, charged = wired(tmp_path, monkeypatch, values)
    assert await exchange.aggregate(Aggregate(4, 0, updates("a", "copier"))) is None
    assert charged == []


async def test_a_sign_flipped_update_is_left_out_and_said_so(tmp_path, monkeypatch):
    values = {mid(p): own_values(p, NUMEL, 0.5) for p in ("a", "b", "c")}
    values[mid("flip")] = values[mid("a")] * -10.0
    exchange, charged = wired(tmp_path, monkeypatch, values)
    made = await exchange.aggregate(Aggregate(4, 0, updates("a", "b", "c", "flip")))
    assert made.included == ("a", "b", "c") and (made.screened, made.screened_why) == (("flip",), ("opposed",))
    assert dict(exchange.screened) == {"opposed": 1} and charged == []
    assert await recomputed(exchange, "a", "b", "c", screened={"flip": "opposed"}) == made.result_hash
    # An aggregator that calls an honest producer opposed to drop it (and have it charged) is caught.
    assert await recomputed(exchange, "a", "b", "flip", screened={"c": "opposed"}) == UNDECODABLE


async def test_an_aggregator_does_not_wait_for_a_producer_it_banned(tmp_path, monkeypatch, autojump_clock):
    values = {mid(p): own_values(p, NUMEL, 0.5) for p in ("a", "b", "c")}
    exchange, _ = wired(tmp_path, monkeypatch, values)
    exchange.banned = lambda peer: peer == "gone"
    started = trio.current_time()
    made = await exchange.aggregate(Aggregate(4, 0, updates("a", "b", "c", "gone")))  # "gone" is never fetched
    assert made.included == ("a", "b", "c") and trio.current_time() - started < 1
