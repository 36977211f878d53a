"""Netlab: test hosts as Linux network namespaces on a private, rate-limited bridge."""

# Standard library only and one file on purpose, past 500 lines: it runs as root, often outside the
# project's virtualenv, and re-runs itself inside the hosts (`_sink`, `_send`) by its own path.
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

PROJECT_PREFIX = "shl"
STATE_DIR = Path("/run/shoal-netlab" if Path("/run").is_dir() else "/tmp/shoal-netlab")
MAX_HOSTS = 250
IP_TIMEOUT_S = 10.0
STOP_GRACE_S = 3.0
LINK_WAIT_S = 3.0
SINK_PORT = 47001
HOST_LINK = "eth0"
BRIDGE = "br0"

_PREFIX_RE = re.compile(rf"^{PROJECT_PREFIX}[a-z0-9]{{5}}$")
_NAMESPACE_RE = re.compile(rf"^({PROJECT_PREFIX}[a-z0-9]{{5}})-")
_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)?")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class NetlabError(RuntimeError):
    """The kernel or iproute2 refused to build or change the lab."""


def unavailable_reason() -> str | None:
    """One line saying why netlab cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "netlab needs root to create network namespaces; run as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"netlab needs {' and '.join(missing)} on PATH; install iproute2"
    return None


def parse_rate_bits(rate: str | int) -> int:
    """'50mbit', '500kbit', '1gbit' or a plain number of bits per second."""
    match = None if isinstance(rate, int) else _RATE_RE.fullmatch(rate.strip().lower())
    if match is None and not isinstance(rate, int):
        raise ValueError(f"rate {rate!r} is not like '50mbit', '500kbit' or '1gbit'")
    rate_bits = rate if match is None else int(float(match[1]) * _RATE_UNITS[match[2] or "bit"])
    if rate_bits < 8_000:
        raise ValueError(f"rate {rate!r} is below 8kbit; tbf cannot shape that slowly")
    return rate_bits


def _run(argv: list[str], *, check: bool = True) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise NetlabError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def _list_namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _state_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def _read_state(prefix: str) -> dict | None:
    try:
        return json.loads(_state_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, or None for no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _owner_alive(state: dict) -> bool:
    # The start time tells a live owner apart from a later process that reused its pid.
    stat = _proc_stat(state["owner_pid"])
    return stat is not None and int(stat[19]) == state["owner_start_ticks"]


def _stop_pids(pids: list[int]) -> None:
    def running(pid: int) -> bool:
        stat = _proc_stat(pid)
        return stat is not None and stat[0] != "Z"

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(running(pid) for pid in pids):
            time.sleep(0.05)


def _teardown(prefix: str) -> None:
    # A second SIGTERM or Ctrl-C must not strand half a lab: hold both until this returns.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        namespaces = [ns for ns in _list_namespaces() if ns.startswith(f"{prefix}-")]
        # A process left inside a namespace keeps it and its links alive after `ip netns del`;
        # anything in there was started through this lab, so it goes with it.
        pids = [int(p) for ns in namespaces for p in _run(["ip", "netns", "pids", ns]).split()]
        _stop_pids([pid for pid in pids if pid != os.getpid()])
        for ns in namespaces:
            _run(["ip", "netns", "del", ns])
        _state_path(prefix).unlink(missing_ok=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def stale_prefixes() -> list[str]:
    """Labs with the project's prefix whose owning process is gone (or never recorded)."""
    prefixes = {m[1] for ns in _list_namespaces() if (m := _NAMESPACE_RE.match(ns))}
    if STATE_DIR.is_dir():
        prefixes |= {p.stem for p in STATE_DIR.glob("*.json") if _PREFIX_RE.match(p.stem)}
    return [p for p in sorted(prefixes) if (state := _read_state(p)) is None or not _owner_alive(state)]


def destroy_stale() -> list[str]:
    """Remove leftovers of crashed runs; a live run's lab is never touched."""
    removed = stale_prefixes()
    for prefix in removed:
        _teardown(prefix)
    return removed


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    name: str  # "h0", "h1", ... as given to exec/cut/heal
    namespace: str
    address: str  # IPv4 on the lab's private subnet, reachable only from the lab's hosts
    bridge_port: str  # this host's veth end inside the bridge namespace


class Lab:
    """Hosts on one bridge; build it with Lab.create or open_lab, reopen it with Lab.attach."""

    def __init__(self, state: dict) -> None:
        self.prefix: str = state["prefix"]
        self.subnet: str = state["subnet"]
        self.hosts = [Host(**host) for host in state["hosts"]]
        self.bridge_namespace = f"{self.prefix}-br"
        self._state = state
        self._procs: list[subprocess.Popen] = []

    @classmethod
    def create(cls, num_hosts: int, *, rate: str | int | None = None, owner_pid: int | None = None) -> Lab:
        """Build num_hosts hosts, each limited to `rate` up and down (None: unlimited).

        The lab counts as stale, for destroy_stale, once owner_pid (default: this process) exits.
        """
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts={num_hosts} must be between 1 and {MAX_HOSTS}")
        rate_bits = None if rate is None else parse_rate_bits(rate)
        owner_pid = os.getpid() if owner_pid is None else owner_pid
        if (owner_stat := _proc_stat(owner_pid)) is None:
            raise ValueError(f"owner pid {owner_pid} is not a running process")
        prefix = _new_prefix()
        # Labs never see each other, so a shared third octet is harmless; spreading them
        # only makes a stray packet's origin obvious in a capture.
        octet = zlib.crc32(prefix.encode()) % 250 + 1
        hosts = [{"name": f"h{i}", "namespace": f"{prefix}-h{i}", "address": f"10.213.{octet}.{i + 1}",
                  "bridge_port": f"{prefix}p{i}"} for i in range(num_hosts)]
        lab = cls({"prefix": prefix, "subnet": f"10.213.{octet}.0/24", "owner_pid": owner_pid,
                   "owner_start_ticks": int(owner_stat[19]), "hosts": hosts,
                   "rates": {h["name"]: {"up_bits": rate_bits, "down_bits": rate_bits} for h in hosts}})
        # The state file comes first so a crash at any later step leaves a findable lab.
        lab._save()
        try:
            lab._build()
        except BaseException:
            lab.destroy()
            raise
        return lab

    @classmethod
    def attach(cls, prefix: str) -> Lab:
        """The lab another process built, from its state file."""
        state = _read_state(prefix)
        if state is None:
            raise ValueError(f"no lab with prefix {prefix!r}; `status` lists the labs that are up")
        return cls(state)

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = _state_path(self.prefix).with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state, indent=2))
        tmp.replace(_state_path(self.prefix))

    def _build(self) -> None:
        br = self.bridge_namespace
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        for host in self.hosts:
            ns = host.namespace
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Both veth ends are born inside lab namespaces: the root namespace never sees them.
            _run(["ip", "-n", ns, "link", "add", HOST_LINK, "type", "veth",
                  "peer", "name", host.bridge_port, "netns", br])
            _run(["ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", HOST_LINK])
            _run(["ip", "-n", br, "link", "set", host.bridge_port, "master", BRIDGE])
            rates = self._state["rates"][host.name]
            self.set_rate(host.name, up=rates["up_bits"], down=rates["down_bits"])
            self.heal(host.name)

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise ValueError(f"no host {name!r} in lab {self.prefix}; hosts are {[h.name for h in self.hosts]}")

    def argv_in(self, host: str, argv: list[str]) -> list[str]:
        """argv wrapped to run inside the host, for callers that start processes themselves."""
        return ["ip", "netns", "exec", self.host(host).namespace, *argv]

    def env_for(self, host: str, base: dict | None = None) -> dict:
        """base (default: os.environ) plus NETLAB_HOST and NETLAB_ADDRESS."""
        target = self.host(host)
        return {**(os.environ if base is None else base),
                "NETLAB_HOST": target.name, "NETLAB_ADDRESS": target.address}

    def exec(self, host: str, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start argv inside the host; its pid is argv's own, and destroy() stops it."""
        env = self.env_for(host, popen_kwargs.pop("env", None))
        proc = subprocess.Popen(self.argv_in(host, argv), env=env, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], *, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run argv inside the host to completion; output is captured as text."""
        return subprocess.run(self.argv_in(host, argv), env=self.env_for(host),
                              capture_output=True, text=True, timeout=timeout_s)

    def set_rate(self, host: str, *, up: str | int | None, down: str | int | None) -> None:
        """Limit what the host sends (up) and receives (down); None lifts that limit."""
        target = self.host(host)
        rates = {"up_bits": None if up is None else parse_rate_bits(up),
                 "down_bits": None if down is None else parse_rate_bits(down)}
        # Egress tbf on each veth end: no ingress tricks, and no netem, which not every kernel has.
        for rate_bits, ns, dev in ((rates["up_bits"], target.namespace, HOST_LINK),
                                   (rates["down_bits"], self.bridge_namespace, target.bridge_port)):
            if rate_bits is None:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            # About 4 ms of tokens (never under ten full frames) keeps TCP near the set rate
            # without letting a burst skew a short measurement.
            burst_bytes = max(15_140, rate_bits // 8 // 250)
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bits}bit",
                  "burst", str(burst_bytes), "latency", "50ms"])
        self._state["rates"][target.name] = rates
        self._save()

    def cut(self, host: str) -> None:
        """Take the host off the bridge: both ends of its veth go down."""
        target = self.host(host)
        _run(["ip", "-n", target.namespace, "link", "set", HOST_LINK, "down"])
        _run(["ip", "-n", self.bridge_namespace, "link", "set", target.bridge_port, "down"])

    def heal(self, host: str) -> None:
        """Put the host back on the bridge and wait until its link is up."""
        target = self.host(host)
        _run(["ip", "-n", self.bridge_namespace, "link", "set", target.bridge_port, "up"])
        _run(["ip", "-n", target.namespace, "link", "set", HOST_LINK, "up"])
        deadline = time.monotonic() + LINK_WAIT_S
        while not self._link_up(target):
            if time.monotonic() > deadline:
                raise NetlabError(f"{target.name}'s link is not up {LINK_WAIT_S}s after heal")
            time.sleep(0.02)

    def _link_up(self, target: Host) -> bool:
        info = json.loads(_run(["ip", "-j", "-n", target.namespace, "link", "show", HOST_LINK]))
        return info[0].get("operstate") == "UP"

    def status(self) -> dict:
        """Owner, and per host its address, rates and whether it is cut (None: namespace gone)."""
        live = set(_list_namespaces())
        hosts = [{"name": h.name, "namespace": h.namespace, "address": h.address,
                  "cut": not self._link_up(h) if h.namespace in live else None,
                  **self._state["rates"][h.name]} for h in self.hosts]
        return {"prefix": self.prefix, "subnet": self.subnet, "owner_pid": self._state["owner_pid"],
                "owner_alive": _owner_alive(self._state), "hosts": hosts}

    def destroy(self) -> None:
        """Stop every process inside the hosts and remove the namespaces, links and state file."""
        _teardown(self.prefix)
        for proc in self._procs:
            proc.wait(timeout=STOP_GRACE_S)  # reaped here; _teardown already stopped them
        self._procs.clear()


def _new_prefix() -> str:
    taken = {m[1] for ns in _list_namespaces() if (m := _NAMESPACE_RE.match(ns))}
    rng = random.SystemRandom()
    for _ in range(100):
        prefix = PROJECT_PREFIX + "".join(rng.choices(string.ascii_lowercase + string.digits, k=5))
        if prefix not in taken and not _state_path(prefix).exists():
            return prefix
    raise NetlabError("could not find a free lab prefix in 100 tries")


@contextlib.contextmanager
def open_lab(num_hosts: int, *, rate: str | int | None = None):
    """A lab that is removed on exit, however the block ends."""
    with open_labs() as make:
        yield make(num_hosts, rate=rate)


@contextlib.contextmanager
def open_labs():
    """A factory `make(num_hosts, rate=None)`; every lab it made is removed on exit."""
    labs: list[Lab] = []

    def make(num_hosts: int = 2, *, rate: str | int | None = None) -> Lab:
        labs.append(Lab.create(num_hosts, rate=rate))
        return labs[-1]

    try:
        yield make
    finally:
        for lab in labs:
            lab.destroy()


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt here, so `finally` blocks still tear labs down."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve_sink(address: str, port: int, idle_timeout_s: float, max_s: float) -> dict:
    """Inside a host: take one connection and count what arrives, timed from the first byte."""
    with socket.create_server((address, port)) as server:
        server.settimeout(idle_timeout_s)
        print("ready", flush=True)
        first_bytes = total_bytes = 0
        first = last = time.monotonic()
        with contextlib.suppress(OSError):  # accept or recv timing out ends the count
            conn, _ = server.accept()
            deadline = time.monotonic() + max_s
            with conn:
                conn.settimeout(idle_timeout_s)
                while (chunk := conn.recv(1 << 16)) and time.monotonic() < deadline:
                    last = time.monotonic()
                    if total_bytes == 0:
                        first, first_bytes = last, len(chunk)
                    total_bytes += len(chunk)
    # The first chunk arrived at `first`, so only what came after it counts toward the rate.
    return {"bytes": total_bytes, "seconds": last - first, "timed_bytes": total_bytes - first_bytes}


def _send(address: str, port: int, seconds: float, connect_timeout_s: float) -> dict:
    """Inside a host: stream zeros to address:port for `seconds`."""
    try:
        sock = socket.create_connection((address, port), timeout=connect_timeout_s)
    except OSError as exc:
        return {"connected": False, "error": str(exc)}
    deadline = time.monotonic() + seconds
    with sock, contextlib.suppress(OSError):
        sock.settimeout(connect_timeout_s + 5.0)  # a cut link stalls sendall; this keeps it finite
        while time.monotonic() < deadline:
            sock.sendall(bytes(1 << 16))
    return {"connected": True}


def transfer(lab: Lab, src: str, dst: str, *, seconds: float, connect_timeout_s: float = 2.0) -> dict:
    """A plain TCP stream from src to dst; measured_bits is the rate seen by the receiver."""
    me, address = [sys.executable, os.path.abspath(__file__)], lab.host(dst).address
    idle_timeout_s = connect_timeout_s + 3.0
    sink = lab.exec(dst, [*me, "_sink", "--address", address, "--port", str(SINK_PORT),
                          "--idle-timeout-s", str(idle_timeout_s), "--max-s", str(seconds + 30)],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([sink.stdout], [], [], 15.0)
        if not ready or sink.stdout.readline().strip() != "ready":
            raise NetlabError(f"the sink on {dst} did not start within 15s")
        sent = lab.run(src, [*me, "_send", "--address", address, "--port", str(SINK_PORT),
                             "--seconds", str(seconds), "--connect-timeout-s", str(connect_timeout_s)],
                       timeout_s=seconds + connect_timeout_s + 20)
        report = json.loads(sent.stdout or '{"connected": false}')
        if not report["connected"]:
            return {**report, "bytes": 0, "measured_bits": 0.0}
        report |= json.loads(sink.communicate(timeout=seconds + idle_timeout_s + 35)[0])
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(timeout=STOP_GRACE_S)
    report["measured_bits"] = report["timed_bytes"] * 8 / report["seconds"] if report["seconds"] else 0.0
    return report


def reachable(lab: Lab, src: str, dst: str, *, timeout_s: float = 2.0) -> bool:
    """Whether a short TCP stream from src gets any bytes to dst within timeout_s."""
    return transfer(lab, src, dst, seconds=0.2, connect_timeout_s=timeout_s)["bytes"] > 0


def selftest(num_hosts: int = 3, rate: str | int = "50mbit", *, transfer_s: float = 3.0) -> dict:
    """Measure the shaped rate between two hosts, then check that cut blocks and heal restores."""
    if num_hosts < 2:
        raise ValueError("selftest needs --hosts 2 or more")
    rate_bits = parse_rate_bits(rate)
    with open_lab(num_hosts, rate=rate_bits) as lab:
        src, dst = lab.hosts[0].name, lab.hosts[1].name
        measured_bits = transfer(lab, src, dst, seconds=transfer_s)["measured_bits"]
        lab.cut(dst)
        cut_blocks = not reachable(lab, src, dst)
        lab.heal(dst)
        # The sender's neighbour entry may need one resolution round after heal.
        heal_restores = any(reachable(lab, src, dst) for _ in range(3))
    return {"rate_bits": rate_bits, "measured_bits": round(measured_bits),
            "ratio": round(measured_bits / rate_bits, 4),
            "cut_blocks_traffic": cut_blocks, "heal_restores_traffic": heal_restores}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netlab.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a lab, print its prefix and addresses, leave it up")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", help="each host's up and down limit, e.g. 50mbit")
    up.add_argument("--owner-pid", type=int, help="stale once this exits (default: the calling shell)")
    down = sub.add_parser("down", help="remove one lab, or every stale one")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("--prefix")
    which.add_argument("--all-stale", action="store_true")
    # --prefix is required: with parallel runs, a guessed default could hit someone else's lab.
    for name, usage in (("exec", "HOST -- CMD ..."), ("cut", "HOST"), ("heal", "HOST")):
        sub.add_parser(name, help=f"{name} --prefix P {usage}").add_argument("--prefix", required=True)
        sub.choices[name].add_argument("host")
    sub.choices["exec"].add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("status", help="every lab that is up, and the stale ones, as JSON")
    test = sub.add_parser("selftest", help="measure rate, cut and heal on a fresh lab")
    test.add_argument("--hosts", type=int, default=3)
    test.add_argument("--rate", default="50mbit")
    test.add_argument("--transfer-s", type=float, default=3.0)
    test.add_argument("--json-out", type=Path)
    for name, flags in (("_sink", ("idle-timeout-s", "max-s")), ("_send", ("seconds", "connect-timeout-s"))):
        helper = sub.add_parser(name)  # run by transfer() inside a host
        helper.add_argument("--address", required=True)
        helper.add_argument("--port", type=int, required=True)
        for flag in flags:
            helper.add_argument(f"--{flag}", type=float, required=True)
    return parser


def _command(args: argparse.Namespace) -> int:
    if args.command == "_sink":
        print(json.dumps(_serve_sink(args.address, args.port, args.idle_timeout_s, args.max_s)))
    elif args.command == "_send":
        print(json.dumps(_send(args.address, args.port, args.seconds, args.connect_timeout_s)))
    elif (reason := unavailable_reason()) is not None:
        print(f"netlab: {reason}", file=sys.stderr)
        return 2
    elif args.command == "up":
        # `up` exits at once, so by default the lab belongs to the shell that asked for it.
        lab = Lab.create(args.hosts, rate=args.rate, owner_pid=args.owner_pid or os.getppid())
        print(json.dumps({"prefix": lab.prefix, "hosts": {h.name: h.address for h in lab.hosts}}))
    elif args.command == "down":
        if args.all_stale:
            print(json.dumps({"removed": destroy_stale()}))
        else:
            Lab.attach(args.prefix).destroy()
    elif args.command == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            raise ValueError("exec needs a command: exec HOST -- CMD ...")
        lab = Lab.attach(args.prefix)
        os.execvpe("ip", lab.argv_in(args.host, argv), lab.env_for(args.host))
    elif args.command in ("cut", "heal"):
        getattr(Lab.attach(args.prefix), args.command)(args.host)
    elif args.command == "status":
        prefixes = sorted(p.stem for p in STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []
        print(json.dumps({"labs": [Lab.attach(p).status() for p in prefixes],
                          "stale": stale_prefixes()}, indent=2))
    elif args.command == "selftest":
        report = selftest(args.hosts, args.rate, transfer_s=args.transfer_s)
        print(json.dumps(report))
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        passed = report["cut_blocks_traffic"] and report["heal_restores_traffic"]
        return 0 if passed and abs(report["ratio"] - 1) <= 0.15 else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():
            return _command(args)
    except (ValueError, NetlabError) as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netlab: interrupted; any lab it was building or testing is removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
