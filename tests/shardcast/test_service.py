"""ShardcastService on the FakeNetwork: publish/fetch, discovery by id, hostile holders, deaths, restarts, load."""

from __future__ import annotations

import os

import pytest
import torch
import trio

from p2p.framing import send_message
from protocol.envelope import seal
from protocol.keys import Keypair
from protocol.manifest import STATUS_OK, Have, ShardHeader, bitfield_from_indices, manifest_id

from node.shardcast import TOPIC, ShardcastConfig, ShardStore, transfer
from tests.shardcast.conftest import FAST, wait_until


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 96, generator=g),
        "b16": torch.randn(33, generator=g).to(torch.bfloat16),
        "h": torch.randn(7, 5, generator=g).half(),
        "idx": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }


async def _mesh_ready(nodes):
    for a in nodes:
        for b in nodes:
            if a is not b:
                await a.host.wait_for_topic_peer(TOPIC, b.peer_id)


async def test_tensors_round_trip_between_two_nodes(swarm):
    pub = await swarm.add("pub")
    rx = await swarm.add("rx")
    tensors = _tensors()
    with trio.fail_after(20):
        await _mesh_ready([pub, rx])
        m = await pub.service.publish_tensors(tensors, label="theta-1")
        seen = []
        got = await rx.service.fetch(manifest_id(m), progress=seen.append)
    assert got == m and m.kind == "tensors" and m.label == "theta-1"
    loaded = rx.service.load_tensors(got)
    assert list(loaded) == list(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name], t), name
    assert seen[-1].bytes_done == seen[-1].bytes_total == m.total_bytes and seen[-1].num_sources == 1
    stats = rx.service.statistics()
    assert stats.bytes_fetched == m.total_bytes and stats.bytes_fetched_by_peer == {pub.peer_id: m.total_bytes}
    assert pub.service.statistics().shards_served == m.num_shards


async def test_file_round_trip_by_id_without_gossip(swarm, tmp_path):
    pub = await swarm.add("pub")
    src = tmp_path / "model.safetensors"
    src.write_bytes(os.urandom(100_000))
    with trio.fail_after(20):
        m = await pub.service.publish_file(src)
        # A latecomer missed the gossip: it finds manifest and holders over /shoal/manifest/1.
        late = await swarm.add("late")
        got = await late.service.fetch(manifest_id(m))
    assert got.label == "model.safetensors" and got.kind == "file"
    out = tmp_path / "copy.safetensors"
    late.service.export_file(got, out)
    assert out.read_bytes() == src.read_bytes()
    with pytest.raises(ValueError):
        late.service.load_tensors(got)


async def test_unknown_manifest_times_out(swarm):
    node = await swarm.add("alone", config=ShardcastConfig(**{**FAST, "stall_timeout_s": 0.5}))
    with trio.fail_after(10), pytest.raises(TimeoutError):
        await node.service.fetch(b"\x01" * 32)


async def test_hostile_holder_is_penalized_and_fetch_completes(swarm):
    """Scenario 1: a holder announces everything and serves corrupt bytes."""
    pub = await swarm.add("pub")
    evil = await swarm.add("evil")
    rx = await swarm.add("rx")
    with trio.fail_after(30):
        await _mesh_ready([pub, evil, rx])
        m = await pub.service.publish_tensors(_tensors())
        mid = manifest_id(m)
        served_bad = []

        async def corrupt(stream):
            req = await transfer.read_request(stream, transfer.Deadlines())
            size = m.shard_size(req.index)
            await send_message(stream, ShardHeader(manifest_id=mid, index=req.index, status=STATUS_OK,
                                                   nbytes=size, sha256=m.shard_hashes[req.index]))
            await stream.write(os.urandom(size))
            await stream.close_write()
            served_bad.append(req.index)
            await stream.read(1024)

        evil.host.set_stream_handler(transfer.SHARD_PROTOCOL, corrupt)
        await evil.host.publish(TOPIC, seal(Have(manifest_id=mid, num_shards=m.num_shards,
                                                 bitfield=bitfield_from_indices(m.num_shards, range(m.num_shards))),
                                            evil.keypair))
        await wait_until(lambda: evil.peer_id in rx.service.holders(mid))
        got = await rx.service.fetch(mid)
    assert torch.equal(rx.service.load_tensors(got)["w"], _tensors()["w"])
    assert served_bad, "the receiver should have preferred the non-publisher holder first"
    assert (evil.peer_id, "bad_hash") in rx.penalties
    assert all(p == evil.peer_id for p, _ in rx.penalties)
    stats = rx.service.statistics()
    assert stats.shards_rejected.get("bad_hash", 0) >= 1 and evil.peer_id not in stats.bytes_fetched_by_peer


@pytest.mark.slow
async def test_source_dies_mid_transfer_receivers_finish_from_each_other(swarm):
    """Scenario 2: once every shard has a verified copy somewhere, losing the source costs nothing."""
    cfg = ShardcastConfig(**{**FAST, "max_uploads": 1, "min_rate_bytes_per_s": 1e6})
    pub = await swarm.add("pub", config=cfg)
    rxs = [await swarm.add(f"rx{i}", config=cfg) for i in range(3)]
    data = os.urandom(40 * 16 * 1024)
    results = {}
    with trio.fail_after(60):
        await _mesh_ready([pub, *rxs])
        path = swarm.tmp_path / "blob.bin"
        path.write_bytes(data)
        m = await pub.service.publish_file(path)
        mid = manifest_id(m)

        incomplete = []

        def kill_once_covered(_progress):
            # Called as each verified shard lands, so the source dies the moment the last shard has its first
            # copy: the receivers lacking that shard are still fetching, whatever the machine's load.
            held = set().union(*(r.store.held_indices(mid) for r in rxs))
            if len(held) == m.num_shards and not incomplete:
                incomplete.extend(r for r in rxs if len(r.store.held_indices(mid)) < m.num_shards)
                swarm.network.kill(pub.peer_id)

        async with trio.open_nursery() as n:
            for r in rxs:
                async def go(r=r):
                    results[r.name] = await r.service.fetch(mid, progress=kill_once_covered)
                n.start_soon(go)
        await pub.stop()
    assert incomplete, "the source should die while receivers are still fetching"
    for r in rxs:
        out = swarm.tmp_path / f"{r.name}.bin"
        r.service.export_file(results[r.name], out)
        assert out.read_bytes() == data
    assert not any(r.penalties for r in rxs)


async def test_restarted_receiver_resumes_from_verified_shards(swarm):
    """Scenario 3: stop mid-fetch, corrupt one stored shard, restart: only the missing bytes move."""
    pub = await swarm.add("pub", config=ShardcastConfig(**{**FAST, "max_uploads": 1}))
    rx = await swarm.add("rx", config=ShardcastConfig(**{**FAST, "max_downloads": 1}))
    data = os.urandom(20 * 16 * 1024)
    path = swarm.tmp_path / "blob.bin"
    path.write_bytes(data)
    with trio.fail_after(30):
        await _mesh_ready([pub, rx])
        m = await pub.service.publish_file(path)
        mid = manifest_id(m)
        with trio.CancelScope() as scope:
            def stop_halfway(p):
                if p.bytes_done >= m.total_bytes // 2:
                    scope.cancel()
            await rx.service.fetch(mid, progress=stop_halfway)
        await rx.stop()
        held = rx.store.held_indices(mid)
        assert 0 < len(held) < m.num_shards
        victim = m.shard_hashes[min(held)]
        rx.store.shard_path(victim).write_bytes(b"\0" * m.shard_size(min(held)))

        rx2 = await swarm.add("rx", data_dir=rx.data_dir)
        assert rx2.store.last_open_report.shards_corrupt == 1
        got = await rx2.service.fetch(mid)
    expected = sum(m.shard_size(i) for i in range(m.num_shards) if i not in held) + m.shard_size(min(held))
    assert rx2.service.statistics().bytes_fetched == expected
    out = swarm.tmp_path / "out.bin"
    rx2.service.export_file(got, out)
    assert out.read_bytes() == data


@pytest.mark.slow
@pytest.mark.parametrize("num_receivers", [4, 8])
async def test_publisher_uploads_about_one_copy(swarm, num_receivers):
    """Super-seeding: the first source's upload must not grow with the number of receivers."""
    pub = await swarm.add("pub")
    rxs = [await swarm.add(f"rx{i}") for i in range(num_receivers)]
    tensors = {"w": torch.randn(64 * 16 * 1024 // 4)}  # 64 shards of 16 KiB
    with trio.fail_after(60):
        await _mesh_ready([pub, *rxs])
        m = await pub.service.publish_tensors(tensors)
        async with trio.open_nursery() as n:
            for r in rxs:
                n.start_soon(r.service.fetch, manifest_id(m))
    served = pub.service.statistics().bytes_served
    ratio = served / m.total_bytes
    print(f"publisher upload ratio for {num_receivers} receivers: {ratio:.2f}")
    assert ratio <= 1.1
    for r in rxs:
        assert torch.equal(r.service.load_tensors(m)["w"], tensors["w"])
        assert r.service.statistics().bytes_fetched == m.total_bytes
        assert r.service.statistics().haves_sent > 0  # on Have streams: the publisher learnt where shards went
    assert pub.service.statistics().haves_received > 0


async def test_service_gc_keeps_last_versions(swarm):
    pub = await swarm.add("pub", config=ShardcastConfig(**{**FAST, "keep_manifests": 2}))
    manifests = []
    with trio.fail_after(20):
        for v in range(4):
            manifests.append(await pub.service.publish_tensors({"w": torch.full((5000,), float(v))}, version=v))
    kept = pub.store.manifest_ids()
    assert [manifest_id(x) for x in manifests[-2:]] == kept
    assert pub.store.num_shards() == sum(x.num_shards for x in manifests[-2:])


async def test_a_seeded_shard_whose_only_holder_left_is_sent_again(swarm):
    """Super-seeding never strands a shard: once its only recipient is gone, the publisher re-sends it."""
    cfg = ShardcastConfig(**{**FAST, "reseed_after_s": 0.5})
    pub = await swarm.add("pub", config=cfg)
    first = await swarm.add("first", config=cfg)
    data = os.urandom(8 * 16 * 1024)
    path = swarm.tmp_path / "blob.bin"
    path.write_bytes(data)
    with trio.fail_after(30):
        await _mesh_ready([pub, first])
        m = await pub.service.publish_file(path)
        await first.service.fetch(manifest_id(m))
        # The recipient's Haves come back to the publisher, which measures how long they take (Seed.heard).
        seed = pub.service._seeds[manifest_id(m)]
        while len(seed.have_delay_s) < m.num_shards:
            await trio.sleep(0.05)
        assert not seed.awaiting_have
        swarm.network.kill(first.peer_id)
        await first.stop()
        second = await swarm.add("second", config=cfg)
        got = await second.service.fetch(manifest_id(m))
    out = swarm.tmp_path / "out.bin"
    second.service.export_file(got, out)
    assert out.read_bytes() == data
    assert pub.service.statistics().bytes_served == 2 * m.total_bytes
    assert pub.service.statistics().seed_copies_again == {"unheard": m.num_shards}


async def test_a_slow_holder_is_hedged_and_never_holds_up_the_fetch(swarm, tmp_path):
    """Heterogeneous links: a holder that drips its shards (a slow link) is backed up by another holder."""
    cfg = ShardcastConfig(**{**FAST, "hedge_after_s": 0.3, "inactivity_s": 5.0})
    pub = await swarm.add("pub", config=cfg)
    slow = await swarm.add("slow", config=cfg)
    rx = await swarm.add("rx", config=cfg)
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(8 * 16 * 1024))
    drip_s = 0.5
    with trio.fail_after(30):
        await _mesh_ready([pub, slow, rx])
        m = await pub.service.publish_file(src)
        mid = manifest_id(m)

        async def drip(stream):
            # Honest bytes, 1 KiB per drip_s: this holder would need 8 s per shard.
            req = await transfer.read_request(stream, transfer.Deadlines())
            size = m.shard_size(req.index)
            await send_message(stream, ShardHeader(manifest_id=mid, index=req.index, status=STATUS_OK,
                                                   nbytes=size, sha256=m.shard_hashes[req.index]))
            data = src.read_bytes()[req.index * m.shard_bytes:][:size]
            for start in range(0, size, 1024):
                await stream.write(data[start:start + 1024])
                await trio.sleep(drip_s)

        slow.host.set_stream_handler(transfer.SHARD_PROTOCOL, drip)
        await slow.host.publish(TOPIC, seal(Have(manifest_id=mid, num_shards=m.num_shards,
                                                 bitfield=bitfield_from_indices(m.num_shards, range(m.num_shards))),
                                            slow.keypair))
        await wait_until(lambda: slow.peer_id in rx.service.holders(mid))
        start = trio.current_time()
        got = await rx.service.fetch(mid)
        took_s = trio.current_time() - start
    out = tmp_path / "out.bin"
    rx.service.export_file(got, out)
    assert out.read_bytes() == src.read_bytes()
    print(f"\nfetch beside a slow holder: {took_s:.2f} s")
    assert took_s < 16 * drip_s, f"the fetch waited on the slow holder ({took_s:.1f} s)"
    assert rx.service.statistics().bytes_fetched_by_peer == {pub.peer_id: m.total_bytes}
    assert not rx.penalties, "a slow holder is not a hostile one"


async def test_a_copy_of_a_manifest_signed_by_another_is_not_taken_for_the_signers_own(swarm):
    # A manifest's id covers its content, not its signer: anyone can sign the same manifest and answer queries with
    # it. The task layer names whose slice it wants; a copy answered first used to make an honest producer's slice
    # look unsigned by it (its aggregate then recomputed as forged).
    honest = await swarm.add("honest")
    mimic = await swarm.add("mimic")
    rx = await swarm.add("rx")
    with trio.fail_after(30):
        await _mesh_ready([honest, mimic, rx])
        m = await honest.service.publish_tensors(_tensors(), label="task/r1/u0", version=1)
        copy = await mimic.service.publish_tensors(_tensors(), label="task/r1/u0", version=1)
        mid = manifest_id(m)
        assert manifest_id(copy) == mid and rx.store.get_manifest(mid) is None
        got = await rx.service.fetch(mid, signer=mimic.peer_id)  # rx now holds the mimic's copy
        assert got == m and rx.store.get_manifest(mid).signer == mimic.peer_id
        got = await rx.service.fetch(mid, signer=honest.peer_id)
        # A publisher asked for another's copy of its own manifest (one announced it as theirs) keeps its own.
        await honest.service.fetch(mid, signer=mimic.peer_id)
    assert honest.store.get_manifest(mid).signer == honest.peer_id
    assert got == m and rx.store.get_manifest(mid).signer == honest.peer_id
    reopened = ShardStore.open(rx.data_dir)  # and so does its disk
    assert reopened.get_manifest(mid).signer == honest.peer_id
    rx.service.config = ShardcastConfig(**{**FAST, "stall_timeout_s": 0.5})
    with trio.fail_after(10), pytest.raises(TimeoutError):
        await rx.service.fetch(mid, signer=Keypair.from_label("nobody").peer_id)


async def test_a_manifest_released_while_a_peer_fetches_it_is_dropped_once_nobody_asks_for_it(swarm):
    # A joiner half-way through weights their publisher has just replaced must still get them; once nobody has
    # asked for them for serving_grace_s they go, and a peer that asks then is told at once.
    grace = 1.0
    pub = await swarm.add("pub", config=ShardcastConfig(**{**FAST, "serving_grace_s": grace}))
    rx = await swarm.add("rx")
    tensors = {"w": torch.randn(64 * 1024, generator=torch.Generator().manual_seed(1))}  # 16 shards
    with trio.fail_after(20):
        m = await pub.service.publish_tensors(tensors, label="state-1")
        mid = manifest_id(m)
        assert await rx.service.holds(pub.peer_id, mid) is True
        async with trio.open_nursery() as nursery:
            fetched = []

            async def fetch():
                fetched.append(await rx.service.fetch(mid, signer=pub.peer_id))

            nursery.start_soon(fetch)
            await wait_until(lambda: rx.service.statistics().bytes_fetched > 0)
            await pub.service.release([mid])  # mid-fetch, or just after its last shard: within the grace either way
            assert pub.store.get_manifest(mid) is not None and mid in pub.service.releasing()
        assert torch.equal(rx.service.load_tensors(fetched[0])["w"], tensors["w"])
        released_at = trio.current_time()
        await wait_until(lambda: pub.store.get_manifest(mid) is None and pub.store.num_shards() == 0)
        assert trio.current_time() - released_at <= 2 * grace and not pub.service.releasing()
        late = await swarm.add("late")
        assert await late.service.holds(pub.peer_id, mid) is False
        assert await late.service.holds(rx.peer_id, mid) is True  # who fetched it serves it


async def test_tensors_published_in_memory_are_fetched_whole_and_leave_nothing_on_disk(swarm):
    # A node's state each round: served from the tensors' own memory, which the store keeps alive while it
    # serves them, even once the publisher has dropped its own references; released, nothing of it is left.
    pub = await swarm.add("pub")
    rx = await swarm.add("rx")
    tensors = {"w": torch.randn(64 * 1024, generator=torch.Generator().manual_seed(2)), "b": torch.arange(9.0)}
    expected = {name: t.clone() for name, t in tensors.items()}
    with trio.fail_after(20):
        await _mesh_ready([pub, rx])
        m = await pub.service.publish_tensors(tensors, label="state-1", in_memory=True)
        del tensors
        mid = manifest_id(m)
        assert pub.store.shard_bytes_on_disk() == 0 and pub.store.shard_bytes_in_memory() == m.total_bytes
        assert not any(pub.store.shard_dir.rglob("*")) and not any(pub.store.manifest_dir.iterdir())
        got = await rx.service.fetch(mid, signer=pub.peer_id)
    loaded = rx.service.load_tensors(got)
    assert all(torch.equal(loaded[name], t) for name, t in expected.items())
    assert pub.service.statistics().shards_served == m.num_shards
    assert torch.equal(pub.service.load_tensors(m)["w"], expected["w"])
    with trio.fail_after(20):
        await pub.service.release([mid], hold_s=0.0)
    assert pub.store.get_manifest(mid) is None and pub.store.num_shards() == 0


async def test_a_manifest_released_with_no_fetch_under_way_goes_at_once(swarm):
    pub = await swarm.add("pub")
    with trio.fail_after(20):
        m = await pub.service.publish_tensors({"w": torch.zeros(5000)}, label="state-1")
        await pub.service.release([manifest_id(m)])
    assert pub.store.get_manifest(manifest_id(m)) is None and pub.store.num_shards() == 0


async def test_a_peer_that_keeps_asking_for_a_released_manifest_cannot_keep_it_past_its_hold(swarm):
    # Asking within every grace would otherwise keep each released manifest on the publisher's disk for good.
    pub = await swarm.add("pub", config=ShardcastConfig(**{**FAST, "serving_grace_s": 1.0}))
    rx = await swarm.add("rx")
    with trio.fail_after(20):
        m = await pub.service.publish_tensors({"w": torch.zeros(5000)}, label="state-1")
        mid = manifest_id(m)
        assert await rx.service.holds(pub.peer_id, mid) is True
        released_at = trio.current_time()
        await pub.service.release([mid], hold_s=2.0)
        assert mid in pub.service.releasing()
        while pub.store.get_manifest(mid) is not None:
            await rx.service.holds(pub.peer_id, mid)
            await trio.sleep(0.1)
        assert 2.0 <= trio.current_time() - released_at <= 3.0


async def test_a_manifest_gossiped_by_its_signer_is_its_have_and_a_quiet_fetch_announces_nothing(swarm):
    """A publisher sends its manifest and no Have of its own: the manifest says it holds every shard. Data for a few
    known peers (a task's update slice) is published unseeded and fetched quietly: the publisher serves each asker,
    and no Have of it goes out from anyone, gossiped or on a Have stream, then or in a re-announcement."""
    from protocol.envelope import open_sealed
    from protocol.manifest import Haves, Manifest, layout_tensors
    config = ShardcastConfig(**{**FAST, "reannounce_interval_s": 0.2})
    pub, a, b = [await swarm.add(n, config=config) for n in ("pub", "a", "b")]
    sent = {n.name: [] for n in (pub, a, b)}
    for n in (pub, a, b):
        gossip = n.service._gossip

        async def recorded(data, _gossip=gossip, _name=n.name):
            sent[_name].append(open_sealed(data, expect=(Manifest, Have, Haves)).message)
            await _gossip(data)
        n.service._gossip = recorded
        send_haves = n.service._have_streams.send

        async def recorded_haves(haves, peers, _send=send_haves, _name=n.name):
            sent[_name].append(haves)
            await _send(haves, peers)
        n.service._have_streams.send = recorded_haves
    blob = bytearray(os.urandom(40 * 1024))  # 3 shards
    entries, _ = layout_tensors([("payload", "uint8", (len(blob),))])
    with trio.fail_after(20):
        await _mesh_ready([pub, a, b])
        m = await pub.service.publish_blob(blob, entries, label="update", seed=False)
        mid = manifest_id(m)
        await wait_until(lambda: all(n.service.holders(mid).get(pub.peer_id) == {0, 1, 2} for n in (a, b)))
        async with trio.open_nursery() as nursery:
            for n in (a, b):
                nursery.start_soon(lambda n=n: n.service.fetch(mid, signer=pub.peer_id, announce=False))
        await trio.sleep(0.6)  # past two re-announcements
    assert [type(x) for x in sent["pub"]] == [Manifest], "the publisher announced a Have after its manifest"
    for n in (a, b):
        assert not sent[n.name], f"{n.name} announced a quiet fetch: {sent[n.name]}"
        assert bytes(n.service.load_tensors(m)["payload"].numpy()) == bytes(blob)
    stats = pub.service.statistics()
    # Never sent to the swarm; a receiver that asked the other (a query, not a Have, told it) got a shard there.
    assert stats.uploads_refused_seeded == 0 and m.num_shards <= stats.shards_served <= 2 * m.num_shards
    # Quiet is about gossip only: a peer that asks is still told what this node holds, and served.
    late = await swarm.add("late", config=config)
    with trio.fail_after(20):
        await pub.stop()
        await late.service.fetch(mid)
    assert late.service.statistics().bytes_fetched == m.total_bytes


async def test_a_manifest_published_without_gossip_is_found_by_asking(swarm):
    """A node's state each round: published for the rare joiner, its manifest (a line per tensor) is not gossiped to
    every peer; a fetch asks for it by id and gets it, signed by its publisher, with the shards."""
    pub, rx = await swarm.add("pub"), await swarm.add("rx")
    tensors = _tensors()
    with trio.fail_after(20):
        await _mesh_ready([pub, rx])
        m = await pub.service.publish_tensors(tensors, label="state", in_memory=True, gossip=False)
        mid = manifest_id(m)
        await trio.sleep(0.3)
        assert mid not in rx.service._known and not rx.service.holders(mid), "the manifest was gossiped"
        got = await rx.service.fetch(mid, signer=pub.peer_id)
    assert got == m
    for name, t in tensors.items():
        assert torch.equal(rx.service.load_tensors(got)[name], t), name


async def test_a_holder_serves_many_shards_on_a_few_kept_streams(swarm, tmp_path):
    pub = await swarm.add("pub")
    rx = await swarm.add("rx")
    src = tmp_path / "set.bin"
    src.write_bytes(os.urandom(40 * FAST["shard_bytes"]))
    with trio.fail_after(30):
        m = await pub.service.publish_file(src)
        opened = rx.host.statistics().streams_opened
        await rx.service.fetch(manifest_id(m))
        opened = rx.host.statistics().streams_opened - opened  # shard streams, and a manifest query if one
    stats = rx.service.statistics()
    assert stats.shards_fetched == m.num_shards == 40
    # At most max_downloads streams (and a hedge or two), each reused for the shards after its first.
    assert opened <= 2 * rx.service.config.max_downloads + 1
    assert stats.streams_reused >= m.num_shards - opened
    assert stats.download_failures == 0 and not rx.penalties and not pub.penalties


async def test_kept_streams_the_holder_closed_as_idle_are_replaced_without_blame(swarm, tmp_path):
    """The holder waits 2 x stream_idle_s for a next request; a fetcher that keeps its streams longer than that (a
    misconfiguration, or a clock that jumped) finds them closed, asks again on new ones and charges nobody."""
    pub = await swarm.add("pub", config=ShardcastConfig(**{**FAST, "stream_idle_s": 0.1}))
    rx = await swarm.add("rx", config=ShardcastConfig(**{**FAST, "stream_idle_s": 30.0}))
    sets = []
    for i in range(2):
        src = tmp_path / f"set{i}.bin"
        src.write_bytes(os.urandom(8 * FAST["shard_bytes"]))
        sets.append(src)
    with trio.fail_after(30):
        first = await pub.service.publish_file(sets[0])
        await rx.service.fetch(manifest_id(first))
        kept = rx.service._kept.count()
        assert kept >= 1
        await wait_until(lambda: not pub.service.server.idle_streams())  # the holder closed them all
        second = await pub.service.publish_file(sets[1])
        await rx.service.fetch(manifest_id(second))
    stats = rx.service.statistics()
    assert stats.shards_fetched == 16 and stats.download_failures == 0
    assert stats.streams_reused >= kept  # each stale one was taken, found closed, and replaced
    assert not rx.penalties and not pub.penalties
    assert not pub.service.statistics().requests_rejected
