#!/usr/bin/env python3
"""DiLoCo through a real swarm against synchronous data parallel and one node alone, on the same samples.

For each seed, and both from a shared warm start (pretrain_steps of single-worker training, as in
the DiLoCo paper) and from scratch, three runs train the same model on the same corpus for the
same number of sequences and are scored by the same held-out evaluation
(node.train.simulate.heldout_loss: same bytes, batches and seed). The swarm run is K node
processes (scripts/local_swarm.Swarm) training a task whose init_manifest names the starting
weights, published over SHARDCAST on node 0; its final weights are read from node 0's checkpoint.

Bytes per node, sent + received: data parallel as a ring all-reduce moves them (2(K-1)/K of the
gradient per step each way; fp32, and bf16 beside it); DiLoCo as measured on each node's TCP
connections (p2p.wire: gossip, handshakes and framing included) from the task's publication to
its end, for the node that moved the most. The stream payload alone is reported beside it, and
with --netlab each host's interface counters too. Training share: each node's trainer seconds
over its rounds' wall seconds; the lowest node's is reported.

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

from protocol.task import AGGREGATE_COMPRESSIONS, KNOWN_COMPRESSIONS, MAX_FRAGMENTS  # noqa: E402
from scripts.local_swarm import READY_TIMEOUT_S, TASK_ENV, Swarm, netlab_interrupts  # noqa: E402
from scripts.swarm_task import TaskRun, timeout_s  # noqa: E402

FULL = dict(workers=4, rounds=20, inner_steps=40, pretrain_steps=600, seeds="1,2,3", starts="warm,scratch")
QUICK = dict(workers=3, rounds=8, inner_steps=40, pretrain_steps=600, seeds="1,2", starts="warm,scratch")
TARGET_LOSS_GAP_PCT = 3.0
"""Eval-loss gap of DiLoCo against fp32 data parallel, warm start, mean over seeds."""
TARGET_BYTES_RATIO = 1000.0
"""fp32 data parallel's bytes per node over DiLoCo's (the busiest node's, on the wire)."""
TARGET_TRAIN_SHARE = 0.95
"""The lowest node's share of wall time spent training."""


def log(text: str) -> None:
    print(f"bench_diloco: {text}", file=sys.stderr, flush=True)


def make_setup(args, *, seed: int, warm: bool):
    from node.train.inner import AdamWConfig
    from node.train.model import ModelConfig
    from node.train.simulate import SimSetup
    model = ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32)
    return SimSetup(model=model, adamw=AdamWConfig(lr=3e-3), batch_size=8, num_shards=64, seed=seed,
                    pretrain_steps=args.pretrain_steps if warm else 0)


def task_fields(setup, args) -> dict:
    """The swarm's task: the reference runs' model, optimizer, data and batch, K members every round."""
    from node.train.data import build_corpus, corpus_id
    a, m = setup.adamw, setup.model
    return {
        "name": f"bench-diloco-k{args.workers}", "inner_steps": args.inner_steps, "batch_size": setup.batch_size,
        "rounds": args.rounds, "round_deadline_s": 120.0, "min_members": args.workers, "max_members": args.workers,
        "compression": "int8", "aggregation_shards": 2,  # the outer optimizer: the compression's defaults
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


def parse_arm(arm: str) -> tuple[str, str, float, int]:
    """"int8", "int2/int4", "int2+overlap", "int2+overlap=0.25" or "int4/int4+fragments=4": the update compression,
    the aggregates' (int8 unless named after a slash), the task's overlap share and its streaming fragments (F: the
    arm's rounds are F times as many and F times as short, the same steps in all)."""
    codecs, _, rest = arm.partition("+")
    compression, _, aggregate = codecs.partition("/")
    aggregate = aggregate or "int8"
    if compression not in KNOWN_COMPRESSIONS:
        raise ValueError(f"arm {arm!r}: the compression must be one of {', '.join(KNOWN_COMPRESSIONS)}")
    if aggregate not in AGGREGATE_COMPRESSIONS:
        raise ValueError(f"arm {arm!r}: the aggregates' compression must be one of {', '.join(AGGREGATE_COMPRESSIONS)}")
    if not rest:
        return compression, aggregate, 0.0, 1
    name, _, value = rest.partition("=")
    if name == "fragments":
        if not value.isdigit() or not 2 <= int(value) <= MAX_FRAGMENTS:
            raise ValueError(f"arm {arm!r}: fragments must be a whole number within 2..{MAX_FRAGMENTS}")
        return compression, aggregate, 0.0, int(value)
    if name != "overlap":
        raise ValueError(f"arm {arm!r}: after '+' only overlap[=SHARE] or fragments=F is known")
    try:
        overlap = float(value) if value else 1.0
    except ValueError:
        raise ValueError(f"arm {arm!r}: the overlap share must be a number within 0..1") from None
    if not 0 < overlap <= 1:
        raise ValueError(f"arm {arm!r}: the overlap share must be within (0, 1]")
    return compression, aggregate, overlap, 1


def run_swarm(setup, args, start, work_dir: Path, lab, *, arm: str) -> dict:
    from node.train.diloco import load_named, save_named, weights_hash
    from node.train.simulate import heldout_loss

    work_dir.mkdir(parents=True, exist_ok=True)
    init_path = work_dir / "init.safetensors"
    save_named(init_path, start)
    compression, aggregate, overlap, fragments = parse_arm(arm)
    fields = {**task_fields(setup, args), "compression": compression, "aggregate_compression": aggregate,
              **({"overlap": overlap} if overlap else {})}
    if fragments > 1:
        if args.inner_steps % fragments:
            raise ValueError(f"arm {arm!r}: {fragments} fragments do not divide {args.inner_steps} inner steps")
        fields.update(fragments=fragments, inner_steps=args.inner_steps // fragments, rounds=args.rounds * fragments)
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
        log(f"swarm of {args.workers} training task {tid[:16]} for {fields['rounds']} rounds")
        iface_before = interface_bytes(lab) if lab is not None else {}
        deadline, last_round = time.monotonic() + timeout_s(run.fields), None
        while not run.done() and not run.stopped() and time.monotonic() < deadline:
            r = min((run.mine(n).get("round") or 0) for n in swarm.nodes)
            if r != last_round:
                log(f"  round {r}/{fields['rounds']}")
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
    wire, libp2p = report["bytes_wire"], report["bytes_libp2p"]
    per_node = {peer: b["sent"] + b["received"] for peer, b in wire.items()}
    shares = {peer: u["train_fraction"] for peer, u in report["utilization"].items()}
    out = {
        "eval_loss": round(heldout_loss(setup, final), 4),
        "bytes_per_node": max(per_node.values()),
        "bytes_per_node_mean": sum(per_node.values()) // len(per_node),
        "stream_bytes_per_node": max(b["sent"] + b["received"] for b in libp2p.values()),
        "weights_hashes_agree": all(r["hashes_agree"] for r in rounds),
        "rounds": len(rounds), "members_per_round": sorted({r["members"] for r in rounds}),
        "node_eval_losses": [r["eval_loss"] for r in rounds],
        "train_share_by_node": shares,
        "train_share_min": min((x for x in shares.values() if x is not None), default=None),
        "bytes_wire_by_node": wire, "bytes_libp2p_by_node": libp2p,
        "gossip_bytes_sent_by_node": report["gossip_bytes_sent"], "utilization": report["utilization"],
        "seconds": report["task"]["seconds"],
    }
    if iface_before:
        moved = [iface_after[h] - iface_before[h] for h in iface_before]
        out["interface_bytes_per_node"] = max(moved)
    return out


def spread(values: list[float]) -> dict:
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"mean": round(mean, 3), "stdev": round(sd, 3), "min": round(min(values), 3), "max": round(max(values), 3),
            "n": len(values)}


def one_run(args, *, seed: int, warm: bool, work_dir: Path, lab) -> list[dict]:
    """For one seed and one start, side by side: a swarm run per compression, data parallel, one node alone."""
    from node.train.simulate import run_ddp, run_single, start_weights
    setup = make_setup(args, seed=seed, warm=warm)
    start_kind = "warm" if warm else "scratch"
    log(f"seed {seed}, {start_kind} start" + (f": {args.pretrain_steps} warm-up steps" if warm else ""))
    start = start_weights(setup)
    swarms = {}
    for compression in args.compressions:
        name = f"{start_kind}-{seed}-{compression.replace('/', '_')}"
        d = swarms[compression] = run_swarm(setup, args, start, work_dir / name, lab, arm=compression)
        log(f"  swarm, {compression}: eval loss {d['eval_loss']}, {d['bytes_per_node']:,} bytes on the busiest "
            f"node's wire, lowest training share {d['train_share_min']}")
    steps = args.rounds * args.inner_steps
    ddp = run_ddp(setup, workers=args.workers, steps=steps, start=start)
    single = run_single(setup, steps=args.workers * steps, start=start)
    ddp_fp32 = 2 * ddp.bytes_per_node  # run_ddp counts what one node sends; a ring receives as much
    ddp_bf16 = ddp_fp32 // 2
    return [{
        "seed": seed, "start": start_kind, "compression": compression,
        "ddp": {"eval_loss": round(ddp.eval_loss, 4), "bytes_per_node_fp32": ddp_fp32,
                "bytes_per_node_bf16": ddp_bf16, "samples": ddp.samples},
        "diloco": {**d, "samples": args.workers * steps * setup.batch_size},
        "single": {"eval_loss": round(single.eval_loss, 4), "samples": single.samples},
        "loss_gap_pct": round(100 * (d["eval_loss"] / ddp.eval_loss - 1), 2),
        "bytes_ratio": round(ddp_fp32 / d["bytes_per_node"], 1),
        "bytes_ratio_bf16": round(ddp_bf16 / d["bytes_per_node"], 1),
    } for compression, d in swarms.items()]


def summarize(runs: list[dict]) -> dict:
    by_start = {}
    for kind in ("warm", "scratch"):
        these = [r for r in runs if r["start"] == kind]
        if these:
            by_start[kind] = {key: spread([r[key] for r in these])
                              for key in ("loss_gap_pct", "bytes_ratio", "bytes_ratio_bf16")}
            by_start[kind]["train_share_min"] = min(r["diloco"]["train_share_min"] or 0.0 for r in these)
    headline = by_start.get("warm") or by_start["scratch"]
    shares = [r["diloco"]["train_share_min"] or 0.0 for r in runs]
    out = {
        "loss_gap_pct": headline["loss_gap_pct"]["mean"],
        "loss_gap_pct_scratch": by_start["scratch"]["loss_gap_pct"]["mean"] if "scratch" in by_start else None,
        "bytes_ratio": min(r["bytes_ratio"] for r in runs),
        "bytes_ratio_bf16": min(r["bytes_ratio_bf16"] for r in runs),
        "train_share_min": min(shares),
        "hashes_agree": all(r["diloco"]["weights_hashes_agree"] for r in runs),
        "by_start": by_start,
    }
    out["targets"] = {"loss_gap_pct": TARGET_LOSS_GAP_PCT, "bytes_ratio": TARGET_BYTES_RATIO,
                      "train_share_min": TARGET_TRAIN_SHARE}
    out["targets_met"] = {"loss_gap_pct": out["loss_gap_pct"] <= TARGET_LOSS_GAP_PCT,
                          "bytes_ratio": out["bytes_ratio"] >= TARGET_BYTES_RATIO,
                          "train_share_min": out["train_share_min"] >= TARGET_TRAIN_SHARE,
                          "hashes_agree": out["hashes_agree"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} instead of {FULL}")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--inner-steps", type=int)
    parser.add_argument("--pretrain-steps", type=int)
    parser.add_argument("--seeds", help="comma-separated seeds (model init, data order, evaluation batches)")
    parser.add_argument("--starts", help="warm, scratch or both (comma-separated)")
    parser.add_argument("--arms", "--compressions", dest="compressions", default="int8,int4/int4",
                        help="the swarm arms, the candidate default last: an update compression (int8, int4, int2, "
                             "topk), optionally /AGGREGATE for the aggregates' (int8, int4, int2; int8 if left out), "
                             "with +overlap[=SHARE] for the task option overlap (SHARE of a round's steps, default 1) "
                             "or +fragments=F for streaming fragments (F times the rounds, each 1/F of the steps)")
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

    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--seeds must be integers separated by commas, not {args.seeds!r}")
    starts = [x.strip() for x in args.starts.split(",") if x.strip()]
    args.compressions = [x.strip() for x in args.compressions.split(",") if x.strip()]
    try:
        if not args.compressions:
            raise ValueError("name at least one arm")
        for arm in args.compressions:
            parse_arm(arm)
    except ValueError as exc:
        parser.error(f"--arms: {exc}")
    if not seeds or not starts or not set(starts) <= {"warm", "scratch"}:
        parser.error("--seeds needs at least one seed and --starts one of warm, scratch (or both)")

    import torch
    torch.set_num_threads(1)
    t0 = time.monotonic()
    work_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-diloco-"))
    lab_cm = lab = None
    ok = False
    runs: list[dict] = []
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
            for start in starts:
                for seed in seeds:
                    for r in one_run(args, seed=seed, warm=start == "warm", work_dir=work_dir, lab=lab):
                        runs.append(r)
                        log(f"  seed {seed} {start} {r['compression']}: loss gap {r['loss_gap_pct']}%, "
                            f"{r['bytes_ratio']}x fewer bytes than fp32 data parallel")
            ok = True
    finally:
        if lab_cm is not None:
            lab_cm.__exit__(None, None, None)
        if ok and not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            log(f"node data and logs kept in {work_dir}")
    setup = make_setup(args, seed=seeds[0], warm=True)
    arms = {c: summarize([r for r in runs if r["compression"] == c]) for c in args.compressions}
    result = {
        # The headline keys are the last compression's (--compressions lists the candidate default last).
        "default_arm": args.compressions[-1], **arms[args.compressions[-1]],
        "arms": arms,
        "runs": runs,
        "setup": {"workers": args.workers, "rounds": args.rounds, "inner_steps": args.inner_steps,
                  "pretrain_steps": args.pretrain_steps, "batch_size": setup.batch_size, "seeds": seeds,
                  "starts": starts, "compressions": args.compressions, "model": dataclasses.asdict(setup.model),
                  "netlab_rate": args.rate if args.netlab else None},
        "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(result, indent=1, default=str)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
