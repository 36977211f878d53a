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
from protocol.manifest import DEFAULT_SHARD_BYTES  # noqa: E402
from scripts import bench_rates  # noqa: E402
from scripts.local_swarm import Swarm, netlab_interrupts, stop  # noqa: E402

MiB = 1 << 20
SEE_ALL_TIMEOUT_S = 120.0
POLL_S = 0.5
CALL_TIMEOUT_S = 30.0
PUBLISH_TIMEOUT_S = 600.0
UPLOAD_TARGET = 1.1
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


def host_bytes(lab) -> list[tuple[int, int]]:
    """(bytes sent, bytes received) on each netlab host's link, as the kernel counts them."""
    out = []
    for host in lab.hosts:
        done = lab.run(host.name, ["cat", "/sys/class/net/eth0/statistics/tx_bytes",
                                   "/sys/class/net/eth0/statistics/rx_bytes"])
        tx, rx = (int(v) for v in done.stdout.split())
        out.append((tx, rx))
    return out


def run_mode(mode: str, args: argparse.Namespace, work_dir: Path, started: float, *, lab=None,
             source: tuple[Path, str] | None = None) -> dict:
    """One publisher and args.receivers receivers, fresh; returns this mode's figures.

    With ``lab`` the nodes run in that lab's hosts (node i on host i) and each host's link bytes are
    reported; ``source`` is a (path, sha256 hex) file to publish instead of a fresh random one.
    """
    num_nodes = args.receivers + 1
    env = {"SHOAL_SHARD_SINGLE_SOURCE": "true" if mode == "single_source" else "false",
           "SHOAL_SHARD_BYTES": str(args.shard_bytes), "SHOAL_HARDWARE_BENCHMARK": "false"}
    with contextlib.ExitStack() as stack:
        if lab is None and args.netlab:
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
        # The node publishes only files under its publish dir.
        src = swarm.publish_dir / "source.bin"
        if source is None:
            source_sha = _write_random(src, args.size_bytes)
        else:
            shutil.copyfile(source[0], src)
            source_sha = source[1]
        bytes_before = host_bytes(lab) if lab is not None else None
        status_before = controls[0].call("/status")
        t = time.monotonic()
        published = controls[0].call("/shard/publish", {"path": str(src)}, timeout_s=PUBLISH_TIMEOUT_S)
        publish_s = time.monotonic() - t
        mid = published["manifest_id"]
        _say(started, f"{mode}: published {published['shards']} shard(s) in {publish_s:.1f} s; fetching")
        outs = [work_dir / f"out{i}.bin" for i in range(1, num_nodes)]
        t0 = time.time()
        for c, out in zip(controls[1:], outs):
            c.call("/shard/fetch", {"manifest_id": mid, "out": str(out)})
        jobs, publisher_samples = _wait_jobs(controls, mid, args, started, mode)
        done_at = [j["started_at"] + j["seconds"] for j in jobs]
        status_after = controls[0].call("/status")
        shardcast = [status_after["shardcast"], *(c.call("/status")["shardcast"] for c in controls[1:])]
        served = [s["bytes_served"] for s in shardcast]
        link = None
        if lab is not None:
            link = [{"sent": a[0] - b[0], "received": a[1] - b[1]} for a, b in zip(host_bytes(lab), bytes_before)]
    ok = all(j["state"] == "done" for j in jobs) and all(
        out.is_file() and ShardStore.hash_file(out)[0].hex() == source_sha for out in outs)
    one_copy_s = next((t for t, n in publisher_samples if n >= args.size_bytes), None)
    return {"seconds_to_all": round(max(done_at) - t0, 2), "publisher_uploaded_bytes": served[0],
            "publisher_one_copy_s": one_copy_s, "host_link_bytes": link,
            "integrity_ok": ok, "publisher_upload_ratio": round(served[0] / args.size_bytes, 3),
            "seconds_by_receiver": [round(d - t0, 2) for d in done_at],
            "receiver_uploaded_bytes": served[1:], "publish_seconds": round(publish_s, 2),
            "publisher_copies_again": shardcast[0]["seed_copies_again"],
            "publisher_refused_seeded": shardcast[0]["uploads_refused_seeded"],
            # Where the publisher's sending went besides shard payload: its TCP connections' bytes (framing,
            # Noise and Yamux included) and its gossip messages by topic, from the publication to the end.
            "publisher_wire_sent": status_after["wire_bytes"]["sent"] - status_before["wire_bytes"]["sent"],
            "publisher_gossip_sent": {k: v - status_before["gossip_bytes_sent"].get(k, 0)
                                      for k, v in status_after["gossip_bytes_sent"].items()},
            "errors": [j["error"] for j in jobs if j["error"]]}


def _wait_jobs(controls: list[Control], mid: str, args: argparse.Namespace, started: float,
               mode: str) -> tuple[list[dict], list[tuple[float, int]]]:
    """The receivers' finished jobs, and (seconds, bytes served) samples of the publisher meanwhile."""
    deadline = time.monotonic() + args.timeout_s
    last_report = 0.0
    t0 = time.monotonic()
    samples = []
    while True:
        jobs = [c.call(f"/shard/fetch?id={mid}") for c in controls[1:]]
        samples.append((round(time.monotonic() - t0, 2), controls[0].call("/status")["shardcast"]["bytes_served"]))
        if all(j["state"] != "running" for j in jobs):
            return jobs, samples
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mode}: fetches not finished after {args.timeout_s:.0f} s")
        if time.monotonic() - last_report > 2.0:
            last_report = time.monotonic()
            done = sum(j["bytes_done"] for j in jobs) / (len(jobs) * args.size_bytes)
            _say(started, f"{mode}: {100 * done:.0f}% fetched")
        time.sleep(POLL_S)


def raw_rates(args: argparse.Namespace, work_dir: Path, started: float) -> dict:
    """One publisher and one receiver process: plain TCP, a bare libp2p stream, and the shard protocol at the
    benchmark's shard size and at a node's default (32 MiB), each also with a receiver that stores nothing.

    ``goodput_ratio`` is the shard protocol at the benchmark's shard size over the bare stream; the
    ``_unstored`` ratios show how much of the gap is the protocol and how much hashing and writing."""
    nbytes, reps = args.raw_mb * MiB, args.reps
    default = min(DEFAULT_SHARD_BYTES, nbytes)
    arms = (("raw_tcp", "tcp", 0), ("libp2p_stream", "stream", 0),
            ("shard_protocol", "shard", args.shard_bytes),
            ("shard_protocol_unstored", "shard_unstored", args.shard_bytes),
            ("shard_protocol_default_shard", "shard", default),
            ("shard_protocol_default_shard_unstored", "shard_unstored", default))
    runs = {}
    for key, kind, shard_bytes in arms:
        _say(started, f"raw rate: {key}, {reps} x {args.raw_mb} MiB")
        runs[key] = [round(r, 1) for r in bench_rates.measure(kind, nbytes=nbytes, reps=reps,
                                                              work_dir=work_dir / key, shard_bytes=shard_bytes)]
    out: dict[str, Any] = {f"{key}_mb_s": bench_rates.median_mb_s(rates) for key, rates in runs.items()}
    out["raw_runs_mb_s"] = runs
    out["raw_shard_bytes"] = {"benchmark": args.shard_bytes, "default": default}
    stream = out["libp2p_stream_mb_s"]
    for key, _, _ in arms[2:]:
        suffix = key.removeprefix("shard_protocol")
        out[f"goodput_ratio{suffix}"] = round(out[f"{key}_mb_s"] / stream, 3)
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
            for mode in args.modes:
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


def _arm(figures: dict, size_bytes: int, straggler: bool) -> dict:
    """The comparison's view of one arm's run: times, and upload as the publisher's link counted it."""
    link = figures["host_link_bytes"]
    times = figures["seconds_by_receiver"]
    out = {"time_to_all_s": figures.get("seconds_to_all", figures.get("time_to_all_s")),
           "publisher_upload_ratio": round(link[0]["sent"] / size_bytes, 3),
           "integrity_ok": figures["integrity_ok"], "seconds_by_receiver": times,
           "host_link_bytes": link}
    if "publisher_upload_ratio" in figures and "seconds_to_all" in figures:
        out["publisher_payload_ratio"] = figures["publisher_upload_ratio"]
        out["publisher_one_copy_s"] = figures["publisher_one_copy_s"]
    if straggler:
        out["others_done_s"] = max(times[:-1])
        out["straggler_done_s"] = times[-1]
    return out


def run_vs_shardcast(args: argparse.Namespace) -> dict:
    """Shoal and Prime's shardcast in the same labs, one after the other, for each receiver count."""
    from scripts import bench_vs_shardcast as vs
    from scripts import netlab
    started = time.monotonic()
    say = lambda message: _say(started, message)  # noqa: E731
    vs.ensure_venv(say)
    # Not under /tmp: shardcast's processes each get a private /tmp mounted over it.
    (ROOT / ".bench").mkdir(exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="vs-shardcast-", dir=ROOT / ".bench"))
    src = work_dir / "source.bin"
    source = (src, _write_random(src, args.size_bytes))
    floor_s = round(args.size_bytes * 8 / netlab.parse_rate_bits(args.rate), 2)
    result: dict[str, Any] = {"size_bytes": args.size_bytes, "rate": args.rate,
                              "shardcast_shard_bytes": args.shardcast_shard_bytes, "receivers": {}}
    runs = [(n, None) for n in args.receivers_list]
    if args.straggler_rate:
        runs.append((args.straggler_receivers, args.straggler_rate))
    ok = False
    try:
        with netlab_interrupts():
            for n, straggler in runs:
                sub = argparse.Namespace(**{**vars(args), "receivers": n, "netlab": True,
                                            "shard_bytes": args.shard_bytes or default_shard_bytes(args.size_bytes, n)})
                label = f"{n} receivers" + (f", h{n} at {straggler}" if straggler else "")
                try:
                    with netlab.open_lab(n + 1, rate=args.rate) as lab:
                        if straggler:
                            lab.set_rate(lab.hosts[n].name, up=straggler, down=straggler)
                        say(f"{label}: Shoal")
                        shoal = run_mode("swarm", sub, work_dir / f"shoal-{n}-{bool(straggler)}", started, lab=lab,
                                         source=source)
                        say(f"{label}: shardcast")
                        arm_dir = work_dir / f"shardcast-{n}-{bool(straggler)}"
                        arm_dir.mkdir(parents=True)
                        prime = vs.run_shardcast(lab, receivers=n, source=source,
                                                 shard_bytes=args.shardcast_shard_bytes, work_dir=arm_dir,
                                                 timeout_s=args.timeout_s, say=say)
                except RuntimeError as exc:
                    # One receiver count that does not finish (a timeout, a node that died) is reported, not fatal.
                    say(f"{label}: failed: {exc}")
                    result.setdefault("failed", {})[label] = str(exc)
                    continue
                entry = {"floor_s": floor_s, "shard_bytes": sub.shard_bytes,
                         "shoal": _arm(shoal, args.size_bytes, bool(straggler)),
                         "shardcast": _arm(prime, args.size_bytes, bool(straggler))}
                entry["shardcast"]["middle_nodes"] = prime["middle_nodes"]
                entry["shardcast"]["client_restarts"] = prime["client_restarts"]
                for arm in ("shoal", "shardcast"):
                    entry[arm]["time_over_floor"] = round(entry[arm]["time_to_all_s"] / floor_s, 2)
                say(f"{label}: Shoal {entry['shoal']['time_to_all_s']} s / {entry['shoal']['publisher_upload_ratio']}x, "
                    f"shardcast {entry['shardcast']['time_to_all_s']} s / {entry['shardcast']['publisher_upload_ratio']}x "
                    f"(floor {floor_s} s)")
                if straggler:
                    entry["straggler_rate"] = straggler
                    result["straggler"] = {"receivers": n, **entry}
                else:
                    result["receivers"][str(n)] = entry
            if not args.no_raw:
                raw_args = argparse.Namespace(**{**vars(args), "shard_bytes": args.shard_bytes or default_shard_bytes(
                    args.raw_mb * MiB, 4)})
                rates = raw_rates(raw_args, work_dir / "raw", started)
                result["goodput_ratio"] = rates["goodput_ratio"]
                result["raw_rates"] = rates
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            say(f"data and logs kept in {work_dir}")
    result["targets"] = vs_targets(result)
    return result


def vs_targets(result: dict) -> dict:
    out = {}
    for n, entry in result["receivers"].items():
        shoal, prime = entry["shoal"], entry["shardcast"]
        out[n] = {"publisher_upload_at_most_1_1": shoal["publisher_upload_ratio"] <= UPLOAD_TARGET,
                  "time_at_most_1_5_floor": shoal["time_to_all_s"] <= 1.5 * entry["floor_s"],
                  "time_under_half_of_shardcast": shoal["time_to_all_s"] < 0.5 * prime["time_to_all_s"],
                  "all_verified": shoal["integrity_ok"] and prime["integrity_ok"]}
    if "goodput_ratio" in result:
        out["goodput_at_least_0_9"] = result["goodput_ratio"] >= GOODPUT_TARGET
    return out


def targets(result: dict, args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {}
    swarm, single = result.get("swarm"), result.get("single_source")
    if swarm:
        out["publisher_upload_ratio_at_most_1_1"] = swarm["publisher_upload_ratio"] <= UPLOAD_TARGET
    if swarm and single:
        out["time_ratio_swarm_vs_single_source"] = round(swarm["seconds_to_all"] / single["seconds_to_all"], 3)
    if "shard_protocol_mb_s" in result:
        ratio = result["shard_protocol_mb_s"] / result["libp2p_stream_mb_s"]
        out["shard_vs_stream_goodput"] = round(ratio, 3)
        out["shard_goodput_at_least_0_9_of_stream"] = ratio >= GOODPUT_TARGET
    if args.netlab and swarm and single:
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
    parser.add_argument("--modes", default="swarm,single_source", help="comma-separated: swarm, single_source")
    parser.add_argument("--vs-shardcast", action="store_true",
                        help="run Prime Intellect's shardcast beside Shoal in the same netlab hosts (needs root)")
    parser.add_argument("--receivers-list", default="4,8,16", help="with --vs-shardcast: receiver counts to run")
    parser.add_argument("--straggler-rate", default="5mbit",
                        help="with --vs-shardcast: one more run with the last receiver at this rate ('' for none)")
    parser.add_argument("--straggler-receivers", type=int, default=4, help="receivers in the straggler run")
    parser.add_argument("--shardcast-shard-mb", type=float, default=50.0,
                        help="shardcast's shard size in MB (its default: 50 MB)")
    parser.add_argument("--control-proxy", help=argparse.SUPPRESS)
    parser.add_argument("--control-data-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.control_proxy:
        return serve_control_proxy(args.control_proxy, args.control_data_dir)
    if args.vs_shardcast:
        return main_vs_shardcast(parser, args)
    if not 1 <= args.receivers <= 32:
        parser.error("--receivers must be between 1 and 32")
    if not 1 <= args.size_mb <= 4096 or not 1 <= args.raw_mb <= 4096 or not 1 <= args.reps <= 20:
        parser.error("--size-mb and --raw-mb must be 1..4096 MiB and --reps 1..20")
    if args.netlab:
        from scripts import netlab
        if reason := netlab.unavailable_reason():
            parser.error(reason)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - {"swarm", "single_source"}:
        parser.error("--modes takes swarm and/or single_source")
    args.size_bytes = args.size_mb * MiB
    args.shard_bytes = (int(args.shard_mb * MiB) if args.shard_mb
                        else default_shard_bytes(args.size_bytes, args.receivers))
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0 if all(result[mode]["integrity_ok"] for mode in args.modes) else 1


def main_vs_shardcast(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from scripts import netlab
    if reason := netlab.unavailable_reason():
        parser.error(reason)
    try:
        args.receivers_list = [int(n) for n in args.receivers_list.split(",") if n.strip()]
    except ValueError:
        parser.error("--receivers-list takes numbers such as 4,8,16")
    if not args.receivers_list or not all(2 <= n <= 32 for n in args.receivers_list + [args.straggler_receivers]):
        parser.error("receiver counts must be between 2 and 32")
    if not 1 <= args.size_mb <= 4096:
        parser.error("--size-mb must be 1..4096 MiB")
    args.size_bytes = args.size_mb * MiB
    args.shard_bytes = int(args.shard_mb * MiB) if args.shard_mb else 0
    args.shardcast_shard_bytes = int(args.shardcast_shard_mb * 1e6)
    result = run_vs_shardcast(args)
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    entries = [*result["receivers"].values(), *([result["straggler"]] if "straggler" in result else [])]
    return 0 if "failed" not in result and all(e[arm]["integrity_ok"] for e in entries for arm in ("shoal", "shardcast")) else 1


if __name__ == "__main__":
    sys.exit(main())
