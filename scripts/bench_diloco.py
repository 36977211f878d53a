#!/usr/bin/env python3
"""DiLoCo through a real swarm against synchronous data parallel and one node alone, on the same samples.

All three runs start from one warm start (pretrain_steps of single-worker training, as in the
DiLoCo paper), train the same model on the same corpus for the same number of sequences, and
are scored by the same held-out evaluation (node.train.simulate.heldout_loss: same bytes,
batches and seed). The swarm run is K node processes (scripts/local_swarm.Swarm) training a
task whose init_manifest names the warm start, published over SHARDCAST on node 0; its final
weights are read from node 0's checkpoint and scored here.

Bytes per node: data parallel is counted as a ring all-reduce would move it (2(K-1)/K of the
fp32 gradient per step each way); DiLoCo is measured, libp2p stream bytes sent + received from
each node's /status during the task (gossip control messages ride py-libp2p's own streams and
are not in that count; with --netlab the hosts' interface counters, which include them, are
reported too). Both are sent + received.

    python scripts/bench_diloco.py --quick
    python scripts/bench_diloco.py --json-out diloco.json
    python scripts/bench_diloco.py --quick --netlab --rate 20mbit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.local_swarm import READY_TIMEOUT_S, TASK_ENV, Swarm, netlab_interrupts  # noqa: E402
from scripts.swarm_task import TaskRun, timeout_s  # noqa: E402

FULL = dict(workers=4, rounds=20, inner_steps=40, pretrain_steps=600)
QUICK = dict(workers=3, rounds=8, inner_steps=40, pretrain_steps=600)
TARGET_LOSS_GAP_PCT = 3.0
TARGET_BYTES_RATIO = 100.0


def log(text: str) -> None:
    print(f"bench_diloco: {text}", file=sys.stderr, flush=True)


def make_setup(args):
    from node.train.inner import AdamWConfig
    from node.train.model import ModelConfig
    from node.train.simulate import SimSetup
    model = ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32)
    return SimSetup(model=model, adamw=AdamWConfig(lr=3e-3), batch_size=8, num_shards=64,
                    pretrain_steps=args.pretrain_steps)


def task_fields(setup, args) -> dict:
    """The swarm's task: the reference runs' model, optimizer, data and batch, K members every round."""
    from node.train.data import build_corpus, corpus_id
    a, m = setup.adamw, setup.model
    return {
        "name": f"bench-diloco-k{args.workers}", "inner_steps": args.inner_steps, "batch_size": setup.batch_size,
        "rounds": args.rounds, "round_deadline_s": 120.0, "min_members": args.workers, "max_members": args.workers,
        "outer_lr": 0.7, "outer_momentum": 0.9, "compression": "int8", "aggregation_shards": 2,
        "aggregators_per_shard": min(2, args.workers), "seed": setup.seed,
        "model": {"n_layer": m.n_layer, "n_head": m.n_head, "d_model": m.d_model, "seq_len": m.seq_len},
        "dataset": {"kind": "stdlib-corpus", "max_bytes": setup.corpus_bytes,
                    "sha256": corpus_id(build_corpus(setup.corpus_bytes)), "num_shards": setup.num_shards},
        "adamw": {"lr": a.lr, "weight_decay": a.weight_decay, "beta1": a.beta1, "beta2": a.beta2,
                  "warmup_steps": a.warmup_steps},
    }


def interface_bytes(lab) -> dict[str, int]:
    """Bytes through each netlab host's link, both directions: every protocol, gossip and headers included."""
    import subprocess

    from scripts import netlab
    out = {}
    for host in lab.hosts:
        total = 0
        for counter in ("rx_bytes", "tx_bytes"):
            path = f"/sys/class/net/{netlab.HOST_LINK}/statistics/{counter}"
            done = subprocess.run(["ip", "netns", "exec", host.namespace, "cat", path], capture_output=True,
                                  text=True, timeout=10)
            total += int(done.stdout.strip() or 0)
        out[host.name] = total
    return out


def run_swarm(setup, args, start, work_dir: Path, lab) -> dict:
    from node.train.diloco import load_named, save_named, weights_hash
    from node.train.simulate import heldout_loss

    init_path = work_dir / "init.safetensors"
    save_named(init_path, start)
    fields = task_fields(setup, args)
    swarm = Swarm(args.workers, work_dir, lab=lab, env=TASK_ENV)
    try:
        swarm.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not swarm.all_see_all():
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes did not all see each other")
            swarm.update()
            time.sleep(0.2)
        run = TaskRun(swarm, fields)
        run.publish_init(init_path)
        tid = run.publish()
        log(f"swarm of {args.workers} training task {tid[:16]} for {args.rounds} rounds")
        iface_before = interface_bytes(lab) if lab is not None else {}
        deadline, last_round = time.monotonic() + timeout_s(run.fields), None
        while not run.done() and not run.stopped() and time.monotonic() < deadline:
            r = min((run.mine(n).get("round") or 0) for n in swarm.nodes)
            if r != last_round:
                log(f"  round {r}/{args.rounds}")
                last_round = r
            time.sleep(0.5)
        run.collect()
        iface_after = interface_bytes(lab) if lab is not None else {}
        report = run.report()
        ok, verdict = run.ok(report)
        final = load_named(swarm.nodes[0].data_dir / "tasks" / tid / "weights.safetensors")
    finally:
        swarm.stop()
    rounds = report["task"]["rounds"]
    if not ok:
        raise RuntimeError(f"swarm run failed: {verdict}")
    last_hash = rounds[-1]["weights_hash_by_node"][swarm.nodes[0].peer_id]
    assert weights_hash(final).startswith(last_hash), "node 0's checkpoint is not its last agreed weights"
    libp2p = report["bytes_libp2p"]
    per_node = [b["sent"] + b["received"] for b in libp2p.values()]
    out = {
        "eval_loss": round(heldout_loss(setup, final), 4),
        "bytes_per_node": sum(per_node) // len(per_node),
        "weights_hashes_agree": all(r["hashes_agree"] for r in rounds),
        "rounds": len(rounds), "members_per_round": sorted({r["members"] for r in rounds}),
        "node_eval_losses": [r["eval_loss"] for r in rounds],
        "bytes_libp2p_by_node": libp2p, "utilization": report["utilization"],
        "seconds": report["task"]["seconds"],
    }
    if iface_before:
        moved = [iface_after[h] - iface_before[h] for h in iface_before]
        out["interface_bytes_per_node"] = sum(moved) // len(moved)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} instead of {FULL}")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--inner-steps", type=int)
    parser.add_argument("--pretrain-steps", type=int)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--netlab", action="store_true", help="run each node in its own network-namespace host")
    parser.add_argument("--rate", help="per-host rate limit with --netlab, e.g. 20mbit")
    parser.add_argument("--keep", action="store_true", help="keep the nodes' data dirs and logs")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rate and not args.netlab:
        parser.error("--rate needs --netlab")
    if not 2 <= args.workers <= 16:
        parser.error("--workers must be within 2..16")

    import torch

    from node.train.simulate import run_ddp, run_single, start_weights
    torch.set_num_threads(1)
    setup = make_setup(args)
    t0 = time.monotonic()
    log(f"warm start: {args.pretrain_steps} steps")
    start = start_weights(setup)
    work_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-diloco-"))
    lab_cm = lab = None
    ok = False
    try:
        with netlab_interrupts():
            if args.netlab:
                from scripts import netlab
                reason = netlab.unavailable_reason()
                if reason:
                    log(reason)
                    return 2
                lab_cm = netlab.open_lab(args.workers, rate=args.rate)
                lab = lab_cm.__enter__()
            diloco = run_swarm(setup, args, start, work_dir, lab)
            log(f"swarm done: eval loss {diloco['eval_loss']}; data parallel next")
            steps = args.rounds * args.inner_steps
            ddp = run_ddp(setup, workers=args.workers, steps=steps, start=start)
            log("single node next")
            single = run_single(setup, steps=args.workers * steps, start=start)
            ok = True
    finally:
        if lab_cm is not None:
            lab_cm.__exit__(None, None, None)
        if ok and not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            log(f"node data and logs kept in {work_dir}")
    ddp_bytes = 2 * ddp.bytes_per_node  # run_ddp counts what one node sends; a ring receives as much
    result = {
        "ddp": {"eval_loss": round(ddp.eval_loss, 4), "bytes_per_node": ddp_bytes, "samples": ddp.samples},
        "diloco": {**diloco, "samples": args.workers * args.rounds * args.inner_steps * setup.batch_size},
        "single": {"eval_loss": round(single.eval_loss, 4), "samples": single.samples},
        "loss_gap_pct": round(100 * (diloco["eval_loss"] / ddp.eval_loss - 1), 2),
        "bytes_ratio": round(ddp_bytes / diloco["bytes_per_node"], 1),
        "setup": {"workers": args.workers, "rounds": args.rounds, "inner_steps": args.inner_steps,
                  "pretrain_steps": args.pretrain_steps, "batch_size": setup.batch_size,
                  "model": dataclasses.asdict(setup.model),
                  "netlab_rate": args.rate if args.netlab else None},
        "seconds": round(time.monotonic() - t0, 1),
    }
    result["targets_met"] = {"loss_gap_pct": result["loss_gap_pct"] <= TARGET_LOSS_GAP_PCT,
                             "bytes_ratio": result["bytes_ratio"] >= TARGET_BYTES_RATIO}
    text = json.dumps(result, indent=1, default=str)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
