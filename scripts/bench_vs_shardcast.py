"""Shoal beside Prime Intellect's `shardcast` (PyPI 0.3.2): the same netlab hosts, links and file.

`shardcast` is installed into its own virtualenv (.bench/shardcast-venv), never into Shoal's. Its
arm follows its README: an origin server on the publisher's host (the library's OriginServer,
since its CLI cannot broadcast), `shardcast-middle` on the first few receivers' hosts with the
origin upstream, and `shardcast-client` on the rest, pointed at the middle nodes. Its downloader
first fetches a `data1.bin` from every server to rate it, so each server's directory gets one.
A client that finds no version yet (a middle node has not polled the origin) is started again, and
so is one that fell into shardcast's "count unknown" discovery: when a middle node fails one poll
of the single-threaded origin it deletes its distribution file, a client that reads it then asks for
ten shards that do not exist and retries them for ever.
Every process gets a private /tmp (a bind mount inside its `ip netns exec` mount namespace): the
downloader writes its rating probe to the fixed path /tmp/dummy.bin, which hosts of one machine
would otherwise share.
A middle node holds its copy once it logs that every shard arrived; the benchmark then checks
that copy's sha256 itself, since middle nodes verify nothing.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".bench" / "shardcast-venv"
SHARDCAST_REQUIREMENT = "shardcast==0.3.2"
SHARDCAST_PORT = 8000
DUMMY_BYTES = 256 * 1024
"""Size of the data1.bin that shardcast's downloader fetches from every server to rate it."""
CLIENT_RETRY_S = 0.5
READY_TIMEOUT_S = 60.0
ORIGIN_DRIVER = """
import sys
from shardcast.origin_server import OriginServer
data_dir, port, src, shard_bytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
origin = OriginServer(data_dir, port)
print("ready", flush=True)
sys.stdin.readline()
print("broadcast", origin.broadcast(src, shard_size=shard_bytes), flush=True)
sys.stdin.read()
"""


def ensure_venv(say) -> Path:
    """The benchmark's own virtualenv with shardcast installed; created on first use."""
    python = VENV / "bin" / "python"
    probe = [str(python), "-c", "import shardcast, blake3"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    say(f"installing {SHARDCAST_REQUIREMENT} into {VENV} (benchmark only)")
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", SHARDCAST_REQUIREMENT], check=True)
    return python


def num_middle_nodes(receivers: int) -> int:
    """About the square root of the receivers, at least two: a two-level tree."""
    return max(2, round(math.sqrt(receivers)))


def _sha256(paths: list[Path]) -> str:
    import hashlib
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def run_shardcast(lab, *, receivers: int, source: tuple[Path, str], shard_bytes: int, work_dir: Path,
                  timeout_s: float, say) -> dict:
    """One broadcast of ``source`` to ``receivers`` hosts (h1..hN) from h0; returns the arm's figures."""
    from scripts.bench_shardcast import host_bytes
    from scripts.local_swarm import stop
    python = ensure_venv(say)
    bin_dir = python.parent
    src, source_sha = source
    size = src.stat().st_size
    middles = num_middle_nodes(receivers)
    hosts = lab.hosts[:receivers + 1]
    url = {h.name: f"http://{h.address}:{SHARDCAST_PORT}" for h in hosts}
    procs: list[subprocess.Popen] = []
    logs = []

    def start(host, argv, name, **kwargs) -> subprocess.Popen:
        log = open(work_dir / f"{name}.log", "ab")
        logs.append(log)
        private_tmp = work_dir / "tmp" / name
        private_tmp.mkdir(parents=True, exist_ok=True)
        wrapped = ["sh", "-c", 'mount --bind "$0" /tmp && exec "$@"', str(private_tmp), *argv]
        proc = lab.exec(host.name, wrapped, stdout=kwargs.pop("stdout", log), stderr=log, cwd=work_dir, **kwargs)
        procs.append(proc)
        return proc

    def server_dir(name: str) -> Path:
        d = work_dir / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "data1.bin").write_bytes(os.urandom(DUMMY_BYTES))
        return d

    try:
        origin = start(hosts[0], [str(python), "-c", ORIGIN_DRIVER, str(server_dir("origin")), str(SHARDCAST_PORT),
                                  str(src), str(shard_bytes)], "origin", stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
        if origin.stdout.readline().strip() != "ready":
            raise RuntimeError(f"shardcast origin did not start; see {work_dir / 'origin.log'}")
        middle_logs = []
        for i, host in enumerate(hosts[1:middles + 1], start=1):
            start(host, [str(bin_dir / "shardcast-middle"), "--upstream", url["h0"],
                         "--data-dir", str(server_dir(f"middle{i}")), "--port", str(SHARDCAST_PORT),
                         "--check-interval", "1"], f"middle{i}")
            middle_logs.append(work_dir / f"middle{i}.log")
        _wait_for_lines(middle_logs, "Middle node running", READY_TIMEOUT_S)
        before = host_bytes(lab)
        origin.stdin.write("go\n")
        origin.stdin.flush()
        line = origin.stdout.readline().split()
        if not line or line[0] != "broadcast":
            raise RuntimeError(f"shardcast origin did not broadcast; see {work_dir / 'origin.log'}")
        version = line[1]
        t0 = time.monotonic()
        say(f"shardcast: broadcast {version}; {middles} middle nodes, {receivers - middles} clients")
        servers = ",".join(url[h.name] for h in hosts[1:middles + 1])
        clients = {}
        clients_log_at: dict[int, int] = {}

        def client_argv(i: int) -> list[str]:
            out_dir = work_dir / f"client{i}"
            return [str(bin_dir / "shardcast-client"), "--servers", servers, "--version", version,
                    "--output-dir", str(out_dir), "--output-file", str(out_dir / "out.bin")]

        for i, host in enumerate(hosts[middles + 1:], start=middles + 1):
            clients[i] = (host, start(host, client_argv(i), f"client{i}"))
            clients_log_at[i] = 0
        done_at: dict[int, float] = {}
        restarts = 0
        deadline = t0 + timeout_s
        while len(done_at) < receivers:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"shardcast: only {len(done_at)} of {receivers} receivers done after {timeout_s:.0f} s")
            for i, log in enumerate(middle_logs, start=1):
                if i not in done_at and "Finished downloading all" in log.read_text(errors="replace"):
                    done_at[i] = now - t0
            for i, (host, proc) in list(clients.items()):
                if i in done_at:
                    continue
                if proc.poll() is None:
                    log_path = work_dir / f"client{i}.log"
                    if "count unknown" not in log_path.read_text(errors="replace")[clients_log_at[i]:]:
                        continue
                    stop([proc], grace_s=1.0)
                    proc.returncode = 1
                if proc.returncode == 0:
                    done_at[i] = now - t0
                    continue
                restarts += 1
                clients_log_at[i] = (work_dir / f"client{i}.log").stat().st_size
                time.sleep(CLIENT_RETRY_S)
                clients[i] = (host, start(host, client_argv(i), f"client{i}"))
            time.sleep(0.1)
        after = host_bytes(lab)
    finally:
        if procs and procs[0].stdin:
            try:
                procs[0].stdin.close()
            except OSError:
                pass
        stop(procs, grace_s=2.0)
        for log in logs:
            log.close()
    ok = []
    for i in range(1, middles + 1):
        shards = sorted((work_dir / f"middle{i}" / version).glob("shard_*.bin"))
        ok.append(_sha256(shards) == source_sha)
    for i in range(middles + 1, receivers + 1):
        ok.append(_sha256([work_dir / f"client{i}" / "out.bin"]) == source_sha)
    link = [{"sent": a[0] - b[0], "received": a[1] - b[1]} for a, b in zip(after, before)]
    times = [round(done_at[i], 2) for i in range(1, receivers + 1)]
    return {"time_to_all_s": max(times), "seconds_by_receiver": times,
            "publisher_upload_ratio": round(link[0]["sent"] / size, 3), "host_link_bytes": link,
            "middle_nodes": middles, "client_restarts": restarts, "integrity_ok": all(ok),
            "shard_bytes": shard_bytes}


def _wait_for_lines(paths: list[Path], text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for path in paths:
        while not (path.exists() and text in path.read_text(errors="replace")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path.name}: no {text!r} within {timeout_s:.0f} s; see {path}")
            time.sleep(0.2)
