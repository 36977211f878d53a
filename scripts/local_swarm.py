#!/usr/bin/env python3
"""Run N Shoal nodes as separate processes on this machine, show who sees whom, and report JSON.

With --task SPEC.toml the nodes train that task together: it is published through node 0's
control API once every node sees the others, the table follows its rounds, and the report
adds each round's eval loss and every node's weights hash (non-zero exit if they ever differ).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.swarm_task import TaskRun, spec_fields, status_cell, timeout_s, use_local_corpus  # noqa: E402

READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
NETLAB_PORT = 4001
NETLAB_CONTROL_PORT = 7070
CALL_TIMEOUT_S = 30.0
TASK_ENV = {"SHOAL_HARDWARE_BENCHMARK": "false"}
"""Task mode skips the start-up hardware benchmark: it would compete with the other nodes' training."""

# A control-API call made from inside the node's network namespace (netlab hosts are not reachable from here).
_CALL_IN_HOST = """import json, sys
from pathlib import Path
from node.control import call, read_token
from protocol.errors import ShoalError
try:
    token = read_token(Path(sys.argv[4]))
    print(json.dumps(call(sys.argv[1], token=token, body=json.loads(sys.argv[2]), timeout_s=float(sys.argv[3]))))
except ShoalError as exc:
    sys.exit(str(exc))
"""


@dataclass
class SwarmNode:
    index: int
    data_dir: Path
    argv_prefix: list[str]
    listen: str
    control_port: int
    proc: subprocess.Popen | None = None
    watcher: subprocess.Popen | None = None
    peer_id: str = ""
    addr: str = ""
    control_url: str = ""
    started_at: float = 0.0
    ready_at: float = 0.0
    seen_all_at: float | None = None
    peers: dict[str, str] = field(default_factory=dict)  # peer id -> state
    status: dict = field(default_factory=dict)
    exit_code: int | None = None
    ready_event: threading.Event = field(default_factory=threading.Event)
    log_path: Path | None = None
    module: str = "node.cli"
    """What ``python -m`` runs: Shoal's CLI, or a test's modified node (a hostile peer) that wraps it."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for this node alone, over the swarm's."""

    def start(self, bootstrap: str | None, extra_args: list[str], extra_env: dict[str, str]) -> None:
        argv = [sys.executable, "-m", self.module, "start", "--data-dir", str(self.data_dir), "--listen", self.listen,
                "--control-port", str(self.control_port), "--no-mdns", *extra_args]
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        self.log_path = self.data_dir / "node.log"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ready_event, self.exit_code, self.seen_all_at = threading.Event(), None, None
        log = open(self.log_path, "ab")  # a restarted node appends to its log
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **extra_env, **self.env}
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv_prefix + argv, stdout=subprocess.PIPE, stderr=log, env=env,
                                     cwd=str(ROOT), start_new_session=True)
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("shoal ready "):
                fields = dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
                self.peer_id = fields["peer_id"]
                self.control_url = fields["control"]
                self.addr = fields.get("addrs", "").split(",")[0]
                self.ready_at = time.monotonic()
                self.ready_event.set()
            elif line:
                # stderr: stdout carries the launcher's JSON report.
                print(f"[node {self.index}] {line}", file=sys.stderr, flush=True)

    def watch(self, interval_s: float, paths: str = "/peers,/status") -> None:
        argv = [sys.executable, "-m", "node.watch", "--url", self.control_url, "--data-dir", str(self.data_dir),
                "--interval-s", str(interval_s),
                "--paths", paths]
        self.watcher = subprocess.Popen(self.argv_prefix + argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                        start_new_session=True)
        threading.Thread(target=self._read_watcher, daemon=True).start()

    def _read_watcher(self) -> None:
        assert self.watcher is not None and self.watcher.stdout is not None
        for raw in self.watcher.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if "peers" in line:
                self.peers = {p["peer_id"]: p["state"] for p in line["peers"]["peers"]}
            if "status" in line:
                self.status = line["status"]

    def call(self, path: str, body: dict | None = None):
        """GET (or POST a JSON body to) this node's control API; ShoalError with the node's message."""
        from protocol.errors import ShoalError
        if not self.argv_prefix:
            from node.control import call, read_token
            return call(self.control_url + path, token=read_token(self.data_dir), body=body, timeout_s=CALL_TIMEOUT_S)
        argv = [sys.executable, "-c", _CALL_IN_HOST, self.control_url + path, json.dumps(body), str(CALL_TIMEOUT_S),
                str(self.data_dir)]
        done = subprocess.run(self.argv_prefix + argv, capture_output=True, cwd=str(ROOT), timeout=2 * CALL_TIMEOUT_S,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if done.returncode:
            raise ShoalError(done.stderr.decode(errors="replace").strip() or f"control call {path} failed")
        return json.loads(done.stdout)

    def alive_peers(self) -> list[str]:
        return sorted(p for p, state in self.peers.items() if state == "alive")


def stop(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> dict[int, float | None]:
    """SIGTERM each process we started, then SIGKILL whatever is left after the grace period.

    Returns each pid's seconds from SIGTERM to exit (None for one that had to be killed).
    """
    signalled = time.monotonic()
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = signalled + grace_s
    took: dict[int, float | None] = {}
    pending = [p for p in procs]
    while pending and time.monotonic() < deadline:
        for proc in list(pending):
            if proc.poll() is not None:
                took[proc.pid] = round(time.monotonic() - signalled, 2)
                pending.remove(proc)
        time.sleep(0.02)
    for proc in pending:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
            took[proc.pid] = None
        else:
            took[proc.pid] = round(time.monotonic() - signalled, 2)
    return took


class Swarm:
    def __init__(self, num_nodes: int, work_dir: Path, *, lab=None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None):
        self.lab = lab
        self.extra_args = extra_args or []
        # Files the launcher hands the nodes (starting weights, benchmark payloads) go here: the only
        # directory a node's control API reads a named path from.
        self.publish_dir = work_dir / "publish"
        self.publish_dir.mkdir(parents=True, exist_ok=True)
        self.env = {"SHOAL_PUBLISH_DIR": str(self.publish_dir), **(env or {})}
        self.nodes: list[SwarmNode] = []
        for i in range(num_nodes):
            if lab is None:
                prefix, listen, port = [], "/ip4/127.0.0.1/tcp/0", 0
            else:
                host = lab.hosts[i]
                prefix = lab.argv_in(host.name, [])
                listen, port = f"/ip4/{host.address}/tcp/{NETLAB_PORT}", NETLAB_CONTROL_PORT
            self.nodes.append(SwarmNode(i, work_dir / f"node{i}", prefix, listen, port))
        self.work_dir = work_dir
        self.started_at = 0.0
        self.task_id = ""
        self.watch_interval_s = 0.5

    def start(self, watch_interval_s: float = 0.5) -> None:
        self.started_at = time.monotonic()
        self.watch_interval_s = watch_interval_s
        first = self.nodes[0]
        first.start(None, self.extra_args, self.env)
        self._wait_ready([first])
        for node in self.nodes[1:]:
            node.start(first.addr, self.extra_args, self.env)
        self._wait_ready(self.nodes[1:])
        for node in self.nodes:
            node.watch(watch_interval_s)

    def _wait_ready(self, nodes: list[SwarmNode]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for node in nodes:
            while not node.ready_event.wait(0.2):
                if node.proc.poll() is not None:
                    raise RuntimeError(f"node {node.index} exited with {node.proc.returncode} before it was ready; "
                                       f"see {node.log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {node.index} not ready within {READY_TIMEOUT_S:.0f} s; see {node.log_path}")

    def add_node(self) -> SwarmNode:
        """Start one more node (loopback only), bootstrapped to node 0, and watch it once ready."""
        assert self.lab is None, "netlab hosts are created with the lab; size the lab for late joiners"
        node = SwarmNode(len(self.nodes), self.work_dir / f"node{len(self.nodes)}", [], "/ip4/127.0.0.1/tcp/0", 0)
        self.nodes.append(node)
        node.start(self.nodes[0].addr, self.extra_args, self.env)
        self._wait_ready([node])
        node.watch(self.watch_interval_s)
        return node

    def restart_node(self, index: int) -> SwarmNode:
        """Start a stopped node again on its data dir (same key, same checkpoints)."""
        node = self.nodes[index]
        assert node.proc is not None and node.proc.poll() is not None, "stop the node first"
        stop([node.watcher] if node.watcher else [], grace_s=1.0)
        bootstrap = next((n.addr for n in self.nodes if n is not node and n.proc and n.proc.poll() is None), None)
        node.status, node.peers = {}, {}
        node.start(bootstrap, self.extra_args, self.env)
        self._wait_ready([node])
        node.watch(self.watch_interval_s)
        return node

    def update(self) -> None:
        ids = {n.peer_id for n in self.nodes}
        for node in self.nodes:
            if node.seen_all_at is None and set(node.alive_peers()) >= ids - {node.peer_id}:
                node.seen_all_at = time.monotonic()

    def all_see_all(self) -> bool:
        return all(n.seen_all_at is not None for n in self.nodes)

    def stop(self) -> None:
        self.stop_seconds = stop([n.proc for n in self.nodes if n.proc is not None])
        stop([n.watcher for n in self.nodes if n.watcher is not None], grace_s=1.0)
        for node in self.nodes:
            node.exit_code = node.proc.returncode if node.proc else None

    def table(self):
        from rich.table import Table
        table = Table(title=f"who sees whom ({time.monotonic() - self.started_at:.0f} s)")
        table.add_column("node")
        for n in self.nodes:
            table.add_column(str(n.index), justify="center")
        table.add_column("status")
        marks = {"alive": "[green]●[/]", "suspect": "[yellow]◐[/]", "dead": "[red]✕[/]"}
        for n in self.nodes:
            row = [f"{n.index} {n.peer_id[-6:]}"]
            for m in self.nodes:
                row.append("·" if m is n else marks.get(n.peers.get(m.peer_id, ""), " "))
            row.append(status_cell(n, self.task_id))
            table.add_row(*row)
        return table

    def report(self) -> dict:
        # A node cannot see peers that have not started yet: count from the moment the last one was ready.
        all_ready_at = max((n.ready_at for n in self.nodes), default=0.0)
        return {"nodes": [{
            "peer_id": n.peer_id, "pid": n.proc.pid if n.proc else None,
            "peers_seen": n.alive_peers() if n.peers else [],
            "peers_ever_seen": sorted(n.peers),
            "seconds_to_see_all": None if n.seen_all_at is None else round(max(0.0, n.seen_all_at - all_ready_at), 2),
            "exit_code": n.exit_code, "stop_seconds": getattr(self, "stop_seconds", {}).get(n.proc.pid) if n.proc else None,
            "log": str(n.log_path)} for n in self.nodes]}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from protocol.errors import ShoalError

    console = Console(stderr=True)
    fields = None
    if args.task:
        try:
            fields = spec_fields(args.task, rounds=args.rounds)
            note = use_local_corpus(fields)
            if note:
                console.print(f"local_swarm: {note}")
        except ShoalError as exc:
            console.print(f"local_swarm: {exc}")
            return 2
    work_dir = Path(tempfile.mkdtemp(prefix="shoal-swarm-"))
    lab_cm = None
    lab = None
    if args.netlab:
        from scripts import netlab
        reason = netlab.unavailable_reason()
        if reason:
            console.print(f"local_swarm: {reason}")
            return 2
        lab_cm = netlab.open_lab(args.nodes, rate=args.rate)
        lab = lab_cm.__enter__()
    swarm = Swarm(args.nodes, work_dir, lab=lab, env=TASK_ENV if fields else None)
    ok, task_run, verdict = False, None, ""
    try:
        with netlab_interrupts():
            console.print(f"starting {args.nodes} nodes in {work_dir} ({'netlab ' + (args.rate or '') if lab else 'loopback'})")
            swarm.start()
            if fields is None:
                follow(swarm, console, lambda: False, args.duration)
                ok = True
            else:
                if not follow(swarm, console, swarm.all_see_all, READY_TIMEOUT_S):
                    raise ShoalError(f"the nodes did not all see each other within {READY_TIMEOUT_S:.0f} s")
                task_run = TaskRun(swarm, fields)
                if args.init_weights:
                    task_run.publish_init(args.init_weights.resolve())
                swarm.task_id = task_run.publish()
                console.print(f"published task {swarm.task_id[:16]} on node 0 ({fields.get('rounds')} rounds)")
                limit_s = timeout_s(task_run.fields)
                finished = follow(swarm, console, lambda: task_run.done() or bool(task_run.stopped()), limit_s)
                task_run.collect()
                verdict = "; ".join(task_run.stopped()) or ("" if finished else f"not finished within {limit_s:.0f} s")
                ok = True
    except KeyboardInterrupt:
        console.print("interrupted; stopping the nodes")
        ok = fields is None
    except ShoalError as exc:
        console.print(f"local_swarm: {exc}")
    finally:
        swarm.stop()
        if lab_cm is not None:
            lab_cm.__exit__(None, None, None)
    report = swarm.report()
    report["seconds"] = round(time.monotonic() - swarm.started_at, 1)
    task_ok = True
    if task_run is not None:
        report.update(task_run.report())
        task_ok, summary = task_run.ok(report)
        if verdict:
            task_ok, summary = False, verdict
        report["task"]["ok"], report["task"]["verdict"] = task_ok, summary
    text = json.dumps(report, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)
    everyone = all(len(n["peers_seen"]) == args.nodes - 1 for n in report["nodes"])
    clean = all(n["exit_code"] == 0 for n in report["nodes"])
    console.print(f"every node saw the other {args.nodes - 1}: {everyone}; every exit code 0: {clean}")
    if task_run is not None:
        console.print(f"task {task_run.task_id[:16]}: {'ok' if task_ok else 'FAILED'}: {report['task']['verdict']}")
    good = ok and everyone and clean and task_ok
    if good and not args.keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        console.print(f"node data and logs kept in {work_dir}")
    return 0 if good else 1


def follow(swarm: Swarm, console, until, limit_s: float) -> bool:
    """Refresh the live table every half second until ``until()`` or limit_s; True if it came true."""
    from rich.live import Live

    deadline = time.monotonic() + limit_s
    reached, last_cells = False, None
    with Live(swarm.table(), console=console, refresh_per_second=2, transient=not console.is_terminal) as live:
        while time.monotonic() < deadline:
            swarm.update()
            live.update(swarm.table())
            cells = [status_cell(n, swarm.task_id) for n in swarm.nodes]
            if not console.is_terminal and swarm.task_id and cells != last_cells:
                # No live table in a log: one line whenever a node's task status changes instead.
                console.print(f"{time.monotonic() - swarm.started_at:6.0f} s  " + " | ".join(cells))
                last_cells = cells
            if until():
                reached = True
                break
            time.sleep(0.5)
    if not console.is_terminal or reached:
        console.print(swarm.table())
    return reached


class netlab_interrupts:
    """Turn SIGTERM into KeyboardInterrupt so the nodes and any lab are always cleaned up."""

    def __enter__(self):
        self._old = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._old)
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--duration", type=float, default=25.0, help="seconds to run before stopping")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--netlab", action="store_true", help="run each node in its own network-namespace host")
    parser.add_argument("--rate", default=None, help="per-host rate limit with --netlab, e.g. 50mbit")
    parser.add_argument("--keep", action="store_true", help="keep node data dirs and logs")
    parser.add_argument("--task", type=Path, help="task spec TOML: publish it on node 0 and follow it to the end")
    parser.add_argument("--rounds", type=int, help="with --task: override the spec's rounds")
    parser.add_argument("--init-weights", type=Path,
                        help="with --task: safetensors file of starting weights, published over SHARDCAST on node 0")
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= 64:
        parser.error("--nodes must be between 1 and 64")
    if args.rate and not args.netlab:
        parser.error("--rate needs --netlab")
    if (args.rounds is not None or args.init_weights) and not args.task:
        parser.error("--rounds and --init-weights need --task")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
