"""A node's round bookkeeping without training or network, for N rounds through the real store and exchange.

    python scripts/bench_scale.py [--sizes 10000000,100000000] [--rounds 20] [--producers 4] [--slices 4]
                                  [--compression int4/int4] [--json-out FILE]

One node on an in-memory host runs what the runner runs each round, on a flat model of the given size: the
trainer's Δ file, Exchange.publish_update (encode and publish of its slices, at a task's default int4 or
the updates codec ``--compression`` names), the other producers' slices arriving in its ShardStore (hashed
as received, fsynced), Exchange.aggregate of every slice (the worst case: a swarm no larger than the
aggregators per slice), Exchange.apply of the aggregates, the hashes the node announces, the checkpoint,
the published state, and the store's GC as the node runs it. Reported per size: mean seconds per round and
per phase, nanoseconds per parameter, bytes written per parameter (write() calls of this process,
/proc/self/io), and the store's and the whole task directory's size over the model's fp32 bytes after the
last round (a hard-linked file counted once), and beside the store's the state it serves from the memory it
holds anyway (``store_in_memory_to_model_ratio``: never written). ``machine`` gives this CPU's sha256 and copy
speed, the floor under any per-byte figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import trio

from node.shardcast import ShardcastConfig, ShardcastService, ShardStore
from node.tasks import compute, task_files
from node.tasks.checks import KEEP_ROUNDS as CHECKED_ROUNDS
from node.tasks.exchange import Exchange
from node.tasks.service import MIN_KEEP_MANIFESTS
from node.train.codecs import CODECS
from node.train.diloco import OuterNesterov, save_named
from p2p.fake import FakeNetwork
from protocol.keys import Keypair
from protocol.manifest import KIND_TENSORS, build_manifest, layout_tensors, seal_manifest
from protocol.task import (AGGREGATE_COMPRESSIONS, KNOWN_COMPRESSIONS, AggregateAnnounce, AggregationSpec,
                           UpdateAnnounce)
from protocol.task_machine import Aggregate, Apply

TASK_ID = "ab" * 32
SAMPLES = 100


def _written_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, a file with several names (a hard link) counted once."""
    sizes = {(st.st_dev, st.st_ino): st.st_size for st in (p.stat() for p in path.rglob("*") if p.is_file())}
    return sum(sizes.values())


def _receive(store: ShardStore, payload: bytes, label: str, keypair: Keypair) -> str:
    """A peer's slice arriving as the fetcher stores it: hashed chunk by chunk, fsynced, then its manifest."""
    entries, _ = layout_tensors([(compute.PAYLOAD, "uint8", (len(payload),))])
    m = build_manifest(payload, kind=KIND_TENSORS, label=label, version=time.time_ns(), tensors=entries)
    signed = seal_manifest(m, keypair)
    view = memoryview(payload)
    for i, sha in enumerate(m.shard_hashes):
        start, end = m.shard_range(i)
        writer = store.shard_writer(sha, end - start)
        for at in range(start, end, 1 << 20):
            writer.write(view[at:min(end, at + (1 << 20))])
        writer.commit()
    store.put_manifest(signed)
    return signed.manifest_id.hex()


def _checkpoint(directory: Path, state: compute.OuterState) -> None:
    """What the runner's _hold writes before it evaluates and announces (the rest follows in a thread)."""
    task_files.save_weights(directory, state)


class Phases:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def add(self, name: str, started: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


async def _rounds(num_params: int, *, producers: int, slices: int, rounds: int, work_dir: Path,
                  compression: tuple[str, str]) -> dict:
    me = Keypair.from_label("bench-scale-me")
    others = [Keypair.from_label(f"bench-scale-p{i}") for i in range(1, producers)]
    task_dir = work_dir / "task"
    task_dir.mkdir(parents=True)
    store = await trio.to_thread.run_sync(ShardStore.open, work_dir / "store")
    # All Exchange reads here; the plain mean, the aggregation these figures were measured with.
    spec = SimpleNamespace(aggregation_shards=slices, round_deadline_s=600.0, aggregation=AggregationSpec(),
                           compression=compression[0], aggregate_compression=compression[1])
    gen = torch.Generator().manual_seed(0)
    state = compute.OuterState(round=0, weights={"w": torch.randn(num_params, generator=gen)}, outer=OuterNesterov())
    delta = {"w": torch.randn(num_params, generator=gen) * 1e-3}
    bounds = compute.slice_bounds(num_params, slices)
    codec = CODECS[compression[0]]
    theirs = [[codec.encode(torch.randn(b - a, generator=gen) * 1e-3) for a, b in bounds] for _ in others]
    phases, per_round_s, critical_s, written = Phases(), [], [], 0
    async with FakeNetwork().open_host(me) as host, trio.open_nursery() as nursery:
        svc = ShardcastService(host, me, store, config=ShardcastConfig())
        svc.config.keep_manifests = max(svc.config.keep_manifests, MIN_KEEP_MANIFESTS)  # as the task service sets it
        await nursery.start(svc.run)
        exchange = Exchange(shardcast=svc, spec=spec, task_id=TASK_ID, directory=task_dir, keypair=me,
                            penalize=lambda peer, reason: None, num_params=lambda: num_params)
        # Rounds here run back to back without training: keep the aggregates a node whose rounds take minutes
        # keeps (a round's aggregates live two round deadlines past their two rounds, for joiners that follow).
        exchange.aggregate_retention_s = 0.0
        # Slices live as long as on a node whose training checks run (tiny-lm tasks): three rounds past their apply.
        exchange.slices_kept_rounds = CHECKED_ROUNDS
        for r in range(rounds):
            # Fresh bytes every round (a content-addressed store would otherwise keep one copy), untimed.
            delta["w"][0] = 1e-3 * (r + 1)
            fresh = []
            for k, payload in enumerate(theirs):
                fresh.append([bytearray(p) for p in payload])
                for p in fresh[-1]:
                    p[0] = (r + k) % 100  # the first block scale's lowest byte: any value keeps a valid payload
            base_hash = state.weights_hash()
            started_round, written_before = time.perf_counter(), _written_bytes()

            t = time.perf_counter()
            await trio.to_thread.run_sync(save_named, task_dir / "update.safetensors", delta)  # the trainer's Δ
            phases.add("update_file", t)
            t = time.perf_counter()
            mine = await exchange.publish_update(task_dir / "update.safetensors", r)
            phases.add("encode_publish", t)
            t = time.perf_counter()
            updates = [UpdateAnnounce(task_id=TASK_ID, round=r, producer=me.peer_id, base_hash=base_hash,
                                      samples=SAMPLES, manifest_ids=tuple(mine), losses=())]
            for k, kp in enumerate(others):
                ids = [await trio.to_thread.run_sync(_receive, store, bytes(p), f"r{r}/u{s}", kp)
                       for s, p in enumerate(fresh[k])]
                updates.append(UpdateAnnounce(task_id=TASK_ID, round=r, producer=kp.peer_id, base_hash=base_hash,
                                              samples=SAMPLES + k + 1, manifest_ids=tuple(ids), losses=()))
            phases.add("receive", t)
            t = time.perf_counter()
            chosen = []
            for s in range(slices):
                got = await exchange.aggregate(Aggregate(round=r, slice=s, updates=tuple(updates)))
                assert got is not None and len(got.included) == producers
                chosen.append(AggregateAnnounce(task_id=TASK_ID, round=r, slice=s, aggregator=me.peer_id,
                                                included=got.included, inputs=got.inputs,
                                                manifest_id=got.manifest_id,
                                                result_hash=got.result_hash))
            phases.add("aggregate", t)
            t = time.perf_counter()
            new = await exchange.apply(state, Apply(round=r, chosen=tuple(chosen)))
            assert new.round == r + 1 and new.weights is not state.weights
            phases.add("apply", t)
            t = time.perf_counter()
            new.weights_hash(), new.state_hash()
            phases.add("hashing", t)
            t = time.perf_counter()
            await trio.to_thread.run_sync(_checkpoint, task_dir, new)
            phases.add("checkpoint", t)
            t = time.perf_counter()
            await exchange.publish_state(new, f"task/{TASK_ID[:12]}/state{new.round}")
            phases.add("publish_state", t)
            critical_s.append(time.perf_counter() - started_round)
            t = time.perf_counter()
            await trio.to_thread.run_sync(task_files.wait_checkpoint, task_dir)
            phases.add("checkpoint_rest", t)
            state = new
            per_round_s.append(time.perf_counter() - started_round)
            written += _written_bytes() - written_before
            assert len(bounds) == slices
        store_bytes = store.shard_bytes_on_disk() + _dir_bytes(store.manifest_dir)
        in_memory_bytes = store.shard_bytes_in_memory()
        nursery.cancel_scope.cancel()
    model_bytes = 4 * num_params
    mean_s = sum(per_round_s) / rounds
    return {"seconds_per_round": round(mean_s, 3), "ns_per_param": round(1e9 * mean_s / num_params, 2),
            "bytes_written_per_param": round(written / rounds / num_params, 2),
            "store_to_model_ratio": round(store_bytes / model_bytes, 2),
            "store_in_memory_to_model_ratio": round(in_memory_bytes / model_bytes, 2),
            "task_dir_to_model_ratio": round(_dir_bytes(task_dir) / model_bytes, 2),
            "critical_path_s": round(sum(critical_s) / rounds, 3),
            "rounds": rounds, "slowest_round_s": round(max(per_round_s), 3),
            "seconds": {k: round(v / rounds, 3) for k, v in phases.seconds.items()}}


def machine_floor() -> dict:
    """This CPU's sha256 and memory-copy speed right now: the floor under bytes hashed or copied."""
    data = bytes(64 << 20)
    t = time.perf_counter()
    hashlib.sha256(data).digest()
    sha_s = time.perf_counter() - t
    t = time.perf_counter()
    bytearray(data)
    copy_s = time.perf_counter() - t
    return {"sha256_ns_per_byte": round(1e9 * sha_s / len(data), 2),
            "copy_ns_per_byte": round(1e9 * copy_s / len(data), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000000,100000000")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compression", default="int4/int4",
                        help="UPDATES/AGGREGATES codecs (int8, int4, int2, topk / int8, int4, int2); a task's default "
                             "is int4/int4")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.rounds < 1 or args.producers < 1 or args.slices < 1:
        parser.error("--rounds, --producers and --slices must be at least 1")
    compression = tuple(args.compression.split("/"))
    if len(compression) != 2 or compression[0] not in KNOWN_COMPRESSIONS \
            or compression[1] not in AGGREGATE_COMPRESSIONS:
        parser.error(f"--compression must be UPDATES/AGGREGATES with UPDATES one of {', '.join(KNOWN_COMPRESSIONS)} "
                     f"and AGGREGATES one of {', '.join(AGGREGATE_COMPRESSIONS)}, got {args.compression!r}")
    torch.set_num_threads(args.threads)
    sizes = {}
    for n in (int(x) for x in args.sizes.split(",")):
        work_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-scale-"))
        try:
            sizes[n] = trio.run(lambda: _rounds(n, producers=args.producers, slices=args.slices,
                                                rounds=args.rounds, work_dir=work_dir, compression=compression))
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    largest = max(sizes)
    report = {"sizes": sizes, "rounds": args.rounds, "producers": args.producers, "slices": args.slices,
              "compression": args.compression,
              "threads": args.threads, "machine": machine_floor(),
              "store_to_model_ratio": sizes[largest]["store_to_model_ratio"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
