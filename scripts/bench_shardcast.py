#!/usr/bin/env python3
"""SHARDCAST benchmark: a publisher and N receivers as daemon processes, swarm mode against single-source.

For each mode it starts fresh nodes, publishes a random file, starts every receiver's fetch at
once, and reports the time until all of them hold the verified file and what the publisher
uploaded. The raw single-stream rates on this machine (plain TCP, one libp2p stream, the shard
protocol) are measured in the same run so the ratios compare like with like. Progress goes to
stderr, the JSON result to stdout (and to --json-out).

    python scripts/bench_shardcast.py --receivers 4 --size-mb 64
    python scripts/bench_shardcast.py --receivers 4 --size-mb 16 --netlab --rate 50mbit
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from node.shardcast.store import ShardStore  # noqa: E402
from scripts import bench_rates  # noqa: E402
from scripts.local_swarm import Swarm, netlab_interrupts, stop  # noqa: E402

MiB = 1 << 20
SEE_ALL_TIMEOUT_S = 120.0
POLL_S = 0.2
CALL_TIMEOUT_S = 30.0
PUBLISH_TIMEOUT_S = 600.0
UPLOAD_TARGET = 1.5
GOODPUT_TARGET = 0.9
NETLAB_TIME_TARGET = 0.6


def _say(started: float, message: str) -> None:
    print(f"[bench {time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)


class Control:
    """One node's control API, reached through a helper process inside the node's netlab host (if any)."""

    def __init__(self, argv_prefix: list[str], url: str, data_dir: Path):
        argv = [*argv_prefix, sys.executable, str(Path(__file__).resolve()), "--control-proxy", url,
                "--control-data-dir", str(data_dir)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)

    def call(self, path: str, body: dict | None = None, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        self.proc.stdin.write(json.dumps({"path": path, "body": body, "timeout_s": timeout_s}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s + 5)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"control proxy for {path} gave no answer (exit code {self.proc.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{path}: {answer['error']}")
        return answer["answer"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        stop([self.proc], grace_s=2.0)


def serve_control_proxy(url: str, data_dir: Path) -> int:
    """Forward JSON-line requests from stdin to the control API at url until stdin closes."""
    from node import control
    from protocol.errors import ShoalError
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = {"answer": control.call(url + req["path"], token=control.read_token(data_dir), body=req["body"],
                                          timeout_s=req["timeout_s"])}
        except ShoalError as exc:
            out = {"error": str(exc)}
        print(json.dumps(out), flush=True)
    return 0


def _write_random(path: Path, nbytes: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for start in range(0, nbytes, MiB):
            chunk = os.urandom(min(MiB, nbytes - start))
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


def _wait_all_see_all(swarm: Swarm, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not swarm.all_see_all():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the nodes did not all see each other within {timeout_s:.0f} s")
        swarm.update()
        time.sleep(POLL_S)


def run_mode(mode: str, args: argparse.Namespace, work_dir: Path, started: float) -> dict:
    """One publisher and args.receivers receivers, fresh; returns this mode's figures."""
    num_nodes = args.receivers + 1
    env = {"SHOAL_SHARD_SINGLE_SOURCE": "true" if mode == "single_source" else "false",
           "SHOAL_SHARD_BYTES": str(args.shard_bytes), "SHOAL_HARDWARE_BENCHMARK": "false"}
    with contextlib.ExitStack() as stack:
        lab = None
        if args.netlab:
            from scripts import netlab
            lab = stack.enter_context(netlab.open_lab(num_nodes, rate=args.rate))
        swarm = Swarm(num_nodes, work_dir, lab=lab, env=env)
        stack.callback(swarm.stop)
        _say(started, f"{mode}: starting {num_nodes} nodes")
        swarm.start()
        _wait_all_see_all(swarm, SEE_ALL_TIMEOUT_S)
        # The watchers only served the readiness check; they would compete for CPU from here on.
        stop([n.watcher for n in swarm.nodes], grace_s=1.0)
        controls = [Control(n.argv_prefix, n.control_url, n.data_dir) for n in swarm.nodes]
        for c in controls:
            stack.callback(c.close)
        src = swarm.publish_dir / "source.bin"
        source_sha = _write_random(src, args.size_bytes)
        t = time.monotonic()
        published = controls[0].call("/shard/publish", {"path": str(src)}, timeout_s=PUBLISH_TIMEOUT_S)
        publish_s = time.monotonic() - t
        mid = published["manifest_id"]
        _say(started, f"{mode}: published {published['shards']} shard(s) in {publish_s:.1f} s; fetching")
        outs = [work_dir / f"out{i}.bin" for i in range(1, num_nodes)]
        t0 = time.time()
        for c, out in zip(controls[1:], outs):
            c.call("/shard/fetch", {"manifest_id": mid, "out": str(out)})
        jobs = _wait_jobs(controls[1:], mid, args, started, mode)
        done_at = [j["started_at"] + j["seconds"] for j in jobs]
        served = [c.call("/status")["shardcast"]["bytes_served"] for c in controls]
    ok = all(j["state"] == "done" for j in jobs) and all(
        out.is_file() and ShardStore.hash_file(out)[0].hex() == source_sha for out in outs)
    return {"seconds_to_all": round(max(done_at) - t0, 2), "publisher_uploaded_bytes": served[0],
            "integrity_ok": ok, "publisher_upload_ratio": round(served[0] / args.size_bytes, 3),
            "seconds_by_receiver": [round(d - t0, 2) for d in done_at],
            "receiver_uploaded_bytes": served[1:], "publish_seconds": round(publish_s, 2),
            "errors": [j["error"] for j in jobs if j["error"]]}


def _wait_jobs(controls: list[Control], mid: str, args: argparse.Namespace, started: float, mode: str) -> list[dict]:
    deadline = time.monotonic() + args.timeout_s
    last_report = 0.0
    while True:
        jobs = [c.call(f"/shard/fetch?id={mid}") for c in controls]
        if all(j["state"] != "running" for j in jobs):
            return jobs
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mode}: fetches not finished after {args.timeout_s:.0f} s")
        if time.monotonic() - last_report > 2.0:
            last_report = time.monotonic()
            done = sum(j["bytes_done"] for j in jobs) / (len(jobs) * args.size_bytes)
            _say(started, f"{mode}: {100 * done:.0f}% fetched")
        time.sleep(POLL_S)


def raw_rates(args: argparse.Namespace, work_dir: Path, started: float) -> dict:
    nbytes, reps = args.raw_mb * MiB, args.reps
    runs = {}
    for key, kind in (("raw_tcp", "tcp"), ("libp2p_stream", "stream"), ("shard_protocol", "shard")):
        _say(started, f"raw rate: {kind}, {reps} x {args.raw_mb} MiB")
        runs[key] = [round(r, 1) for r in bench_rates.measure(kind, nbytes=nbytes, reps=reps,
                                                              work_dir=work_dir / kind, shard_bytes=args.shard_bytes)]
    out = {f"{key}_mb_s": bench_rates.median_mb_s(rates) for key, rates in runs.items()}
    out["raw_runs_mb_s"] = runs
    return out


def default_shard_bytes(size_bytes: int, receivers: int) -> int:
    """A power of two between 1 and 4 MiB giving every receiver several shards to trade."""
    shard = MiB
    while shard < 4 * MiB and size_bytes // (2 * shard) >= 8 * receivers:
        shard *= 2
    return shard


def run(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    work_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    result: dict[str, Any] = {"size_bytes": args.size_bytes, "receivers": args.receivers,
                              "shard_bytes": args.shard_bytes,
                              "network": f"netlab {args.rate or 'unlimited'}" if args.netlab else "loopback"}
    ok = False
    try:
        with netlab_interrupts():
            if not args.no_raw:
                result.update(raw_rates(args, work_dir / "raw", started))
            for mode in ("swarm", "single_source"):
                result[mode] = run_mode(mode, args, work_dir / mode, started)
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            _say(started, f"node data and logs kept in {work_dir}")
    result["targets"] = targets(result, args)
    _say(started, "done")
    return result


def targets(result: dict, args: argparse.Namespace) -> dict:
    swarm, single = result["swarm"], result["single_source"]
    out: dict[str, Any] = {
        "publisher_upload_ratio_at_most_1_5": swarm["publisher_upload_ratio"] <= UPLOAD_TARGET,
        "time_ratio_swarm_vs_single_source": round(swarm["seconds_to_all"] / single["seconds_to_all"], 3),
    }
    if "shard_protocol_mb_s" in result:
        ratio = result["shard_protocol_mb_s"] / result["libp2p_stream_mb_s"]
        out["shard_vs_stream_goodput"] = round(ratio, 3)
        out["shard_goodput_at_least_0_9_of_stream"] = ratio >= GOODPUT_TARGET
    if args.netlab:
        out["netlab_time_at_most_0_6_single_source"] = out["time_ratio_swarm_vs_single_source"] <= NETLAB_TIME_TARGET
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receivers", type=int, default=4)
    parser.add_argument("--size-mb", type=int, default=64, help="size of the published file in MiB")
    parser.add_argument("--shard-mb", type=float, default=None,
                        help="shard size in MiB (default: 1-4 MiB, enough shards for every receiver)")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--netlab", action="store_true", help="each node in its own rate-limited netlab host")
    parser.add_argument("--rate", default="50mbit", help="per-host rate limit with --netlab")
    parser.add_argument("--raw-mb", type=int, default=64, help="MiB per repetition of the raw rate measurements")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each raw rate (the median is reported)")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw single-stream rates")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up on a mode's fetches after this")
    parser.add_argument("--keep", action="store_true", help="keep node data dirs and logs")
    parser.add_argument("--control-proxy", help=argparse.SUPPRESS)
    parser.add_argument("--control-data-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.control_proxy:
        return serve_control_proxy(args.control_proxy, args.control_data_dir)
    if not 1 <= args.receivers <= 32:
        parser.error("--receivers must be between 1 and 32")
    if not 1 <= args.size_mb <= 4096 or not 1 <= args.raw_mb <= 4096 or not 1 <= args.reps <= 20:
        parser.error("--size-mb and --raw-mb must be 1..4096 MiB and --reps 1..20")
    if args.netlab:
        from scripts import netlab
        if reason := netlab.unavailable_reason():
            parser.error(reason)
    args.size_bytes = args.size_mb * MiB
    args.shard_bytes = (int(args.shard_mb * MiB) if args.shard_mb
                        else default_shard_bytes(args.size_bytes, args.receivers))
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0 if result["swarm"]["integrity_ok"] and result["single_source"]["integrity_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
