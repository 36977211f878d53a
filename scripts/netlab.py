"""Netlab: test hosts as Linux network namespaces on a private, rate-limited bridge."""

# Standard library only: it runs as root, often outside the project's virtualenv.
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
_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)?")
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
    if isinstance(rate, int):
        rate_bits = rate
    else:
        match = _RATE_RE.fullmatch(rate.strip().lower())
        if match is None:
            raise ValueError(f"rate {rate!r} is not like '50mbit', '500kbit' or '1gbit'")
        rate_bits = int(float(match[1]) * _RATE_UNITS[match[2] or "bit"])
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


def _start_ticks(pid: int) -> int | None:
    # The start time tells a live owner apart from a later process that reused its pid.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_alive(state: dict) -> bool:
    ticks = _start_ticks(state["owner_pid"])
    return ticks is not None and ticks == state["owner_start_ticks"]


def _stop_pids(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(_start_ticks(pid) is not None for pid in pids):
            time.sleep(0.05)


def _teardown(prefix: str) -> None:
    namespaces = [ns for ns in _list_namespaces() if ns.startswith(f"{prefix}-")]
    # A process left inside a namespace keeps it and its links alive after `ip netns del`;
    # anything in there was started through this lab, so it goes with it.
    pids = [int(p) for ns in namespaces for p in _run(["ip", "netns", "pids", ns]).split()]
    _stop_pids([pid for pid in pids if pid != os.getpid()])
    for ns in namespaces:
        _run(["ip", "netns", "del", ns])
    _state_path(prefix).unlink(missing_ok=True)


def stale_prefixes() -> list[str]:
    """Labs with the project's prefix whose owning process is gone (or never recorded)."""
    prefixes = {m[1] for ns in _list_namespaces() if (m := _NAMESPACE_RE.match(ns))}
    if STATE_DIR.is_dir():
        prefixes |= {p.stem for p in STATE_DIR.glob("*.json") if _PREFIX_RE.match(p.stem)}
    stale = []
    for prefix in sorted(prefixes):
        state = _read_state(prefix)
        if state is None or not _owner_alive(state):
            stale.append(prefix)
    return stale


def destroy_stale() -> list[str]:
    """Remove leftovers of crashed runs; a live run's lab is never touched."""
    removed = stale_prefixes()
    for prefix in removed:
        _teardown(prefix)
    return removed


def _tbf_args(rate_bits: int) -> list[str]:
    # About 4 ms of tokens (never under ten full frames) keeps TCP near the set rate
    # without letting a burst skew a short measurement.
    burst_bytes = max(15_140, rate_bits // 8 // 250)
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst_bytes), "latency", "50ms"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    name: str  # "h0", "h1", ... as given to exec/cut/heal
    namespace: str
    address: str  # IPv4 on the lab's private subnet, reachable only from the lab's hosts
    bridge_port: str  # this host's veth end inside the bridge namespace


class Lab:
    """A set of hosts on one bridge; build it with Lab.create or open_lab, find it with Lab.attach."""

    def __init__(self, state: dict) -> None:
        self.prefix: str = state["prefix"]
        self.subnet: str = state["subnet"]
        self.owner_pid: int = state["owner_pid"]
        self.hosts = [Host(**host) for host in state["hosts"]]
        self._state = state
        self._procs: list[subprocess.Popen] = []

    @property
    def bridge_namespace(self) -> str:
        return f"{self.prefix}-br"

    @classmethod
    def create(
        cls, num_hosts: int, *, rate: str | int | None = None, prefix: str | None = None,
        owner_pid: int | None = None,
    ) -> Lab:
        """Build num_hosts hosts, each limited to `rate` up and down (None: unlimited)."""
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts={num_hosts} must be between 1 and {MAX_HOSTS}")
        rate_bits = None if rate is None else parse_rate_bits(rate)
        if prefix is None:
            prefix = _new_prefix()
        elif not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must be '{PROJECT_PREFIX}' and 5 of [a-z0-9]")
        owner_pid = os.getpid() if owner_pid is None else owner_pid
        owner_start_ticks = _start_ticks(owner_pid)
        if owner_start_ticks is None:
            raise ValueError(f"owner pid {owner_pid} is not a running process")
        # Labs never see each other, so a shared third octet is harmless; spreading them
        # only makes a stray packet's origin obvious in a capture.
        octet = zlib.crc32(prefix.encode()) % 250 + 1
        hosts = [
            {"name": f"h{i}", "namespace": f"{prefix}-h{i}", "address": f"10.213.{octet}.{i + 1}",
             "bridge_port": f"{prefix}p{i}"}
            for i in range(num_hosts)
        ]
        lab = cls({
            "prefix": prefix, "subnet": f"10.213.{octet}.0/24", "owner_pid": owner_pid,
            "owner_start_ticks": owner_start_ticks, "hosts": hosts,
            "rates": {h["name"]: {"up_bits": rate_bits, "down_bits": rate_bits} for h in hosts},
        })
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
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
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

    def exec(self, host: str, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start argv inside the host; the Popen's pid is argv's own, so stop it by pid.

        It sees SHOAL_NETLAB_HOST and SHOAL_NETLAB_ADDRESS, and is stopped on destroy().
        """
        target = self.host(host)
        env = _host_env(target, popen_kwargs.pop("env", None))
        proc = subprocess.Popen(["ip", "netns", "exec", target.namespace, *argv], env=env, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], *, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run argv inside the host to completion and capture its output as text."""
        target = self.host(host)
        return subprocess.run(["ip", "netns", "exec", target.namespace, *argv],
                              capture_output=True, text=True, timeout=timeout_s)

    def set_rate(self, host: str, *, up: str | int | None, down: str | int | None) -> None:
        """Limit what the host sends (up) and receives (down); None lifts that limit."""
        target = self.host(host)
        rates = {}
        for direction, rate, ns, dev in (("up", up, target.namespace, HOST_LINK),
                                         ("down", down, self.bridge_namespace, target.bridge_port)):
            # Egress shaping on each veth end: tbf needs no ingress tricks and works without netem.
            rates[f"{direction}_bits"] = None if rate is None else parse_rate_bits(rate)
            if rate is None:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root",
                      *_tbf_args(rates[f"{direction}_bits"])])
        self._state["rates"][target.name] = rates
        self._save()

    def cut(self, host: str) -> None:
        """Take the host off the bridge: both ends of its veth go down."""
        target = self.host(host)
        _run(["ip", "-n", target.namespace, "link", "set", HOST_LINK, "down"])
        _run(["ip", "-n", self.bridge_namespace, "link", "set", target.bridge_port, "down"])

    def heal(self, host: str) -> None:
        """Put the host back on the bridge and wait until its link carries traffic."""
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
        """What the lab is now: owner, and per host its address, rates and whether it is cut."""
        live = set(_list_namespaces())
        hosts = []
        for host in self.hosts:
            present = host.namespace in live
            hosts.append({"name": host.name, "namespace": host.namespace, "address": host.address,
                          "present": present, "cut": present and not self._link_up(host),
                          **self._state["rates"][host.name]})
        return {"prefix": self.prefix, "subnet": self.subnet, "owner_pid": self.owner_pid,
                "owner_alive": _owner_alive(self._state), "hosts": hosts}

    def destroy(self) -> None:
        """Stop the lab's processes and remove its namespaces, links and state file."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=STOP_GRACE_S)
        self._procs.clear()
        _teardown(self.prefix)


def _host_env(host: Host, base: dict | None = None) -> dict:
    return {**(os.environ if base is None else base),
            "SHOAL_NETLAB_HOST": host.name, "SHOAL_NETLAB_ADDRESS": host.address}


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
    lab = Lab.create(num_hosts, rate=rate)
    try:
        yield lab
    finally:
        lab.destroy()


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
    """Inside a host: take one connection, count what arrives, report bytes and seconds."""
    with socket.create_server((address, port)) as server:
        server.settimeout(idle_timeout_s)
        print("ready", flush=True)
        try:
            conn, _ = server.accept()
        except TimeoutError:
            return {"bytes": 0, "seconds": 0.0}
        total_bytes = timed_bytes = 0
        first = last = time.monotonic()
        deadline = first + max_s
        with conn:
            conn.settimeout(idle_timeout_s)
            with contextlib.suppress(OSError):
                while (chunk := conn.recv(1 << 16)) and time.monotonic() < deadline:
                    last = time.monotonic()
                    if total_bytes == 0:
                        first = last  # rate counts from the first byte, not from accept
                    else:
                        timed_bytes += len(chunk)
                    total_bytes += len(chunk)
        return {"bytes": total_bytes, "seconds": last - first, "timed_bytes": timed_bytes}


def _send(address: str, port: int, seconds: float, connect_timeout_s: float) -> dict:
    """Inside a host: stream zeros to address:port for `seconds`."""
    try:
        sock = socket.create_connection((address, port), timeout=connect_timeout_s)
    except OSError as exc:
        return {"connected": False, "error": str(exc)}
    payload = bytes(1 << 16)
    deadline = time.monotonic() + seconds
    with sock:
        # A cut link stalls sendall; the timeout keeps that finite.
        sock.settimeout(connect_timeout_s + 5.0)
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                sock.sendall(payload)
    return {"connected": True}


def transfer(lab: Lab, src: str, dst: str, *, seconds: float, connect_timeout_s: float = 2.0) -> dict:
    """A plain TCP stream from src to dst, measured at the receiver."""
    me = [sys.executable, os.path.abspath(__file__)]
    idle_timeout_s = connect_timeout_s + 3.0
    sink = lab.exec(dst, [*me, "_sink", "--address", lab.host(dst).address, "--port", str(SINK_PORT),
                          "--idle-timeout-s", str(idle_timeout_s), "--max-s", str(seconds + 30)],
                    stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([sink.stdout], [], [], 15.0)
        if not ready or sink.stdout.readline().strip() != "ready":
            raise NetlabError(f"sink on {dst} did not start within 15s")
        sent = lab.run(src, [*me, "_send", "--address", lab.host(dst).address, "--port", str(SINK_PORT),
                             "--seconds", str(seconds), "--connect-timeout-s", str(connect_timeout_s)],
                       timeout_s=seconds + connect_timeout_s + 20)
        sent_report = json.loads(sent.stdout or '{"connected": false}')
        if not sent_report["connected"]:
            return {**sent_report, "bytes": 0, "measured_bits": 0.0}
        out, _ = sink.communicate(timeout=seconds + idle_timeout_s + 35)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(timeout=STOP_GRACE_S)
    received = json.loads(out)
    measured_bits = received["timed_bytes"] * 8 / received["seconds"] if received.get("seconds") else 0.0
    return {**sent_report, **received, "measured_bits": measured_bits}


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
        measured = transfer(lab, src, dst, seconds=transfer_s)
        lab.cut(dst)
        cut_blocks = not reachable(lab, src, dst)
        lab.heal(dst)
        # The sender's neighbour entry may need one resolution round after heal.
        heal_restores = any(reachable(lab, src, dst) for _ in range(3))
    return {"rate_bits": rate_bits, "measured_bits": round(measured["measured_bits"]),
            "ratio": round(measured["measured_bits"] / rate_bits, 4),
            "cut_blocks_traffic": cut_blocks, "heal_restores_traffic": heal_restores}


def selftest_passed(report: dict, *, tolerance: float = 0.15) -> bool:
    return (abs(report["ratio"] - 1.0) <= tolerance and report["cut_blocks_traffic"]
            and report["heal_restores_traffic"])


def _resolve_prefix(prefix: str | None) -> str:
    if prefix is not None:
        return prefix
    up = sorted(p.stem for p in STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []
    if len(up) != 1:
        raise ValueError(f"{'no lab is up' if not up else f'labs {up} are up'}; pass --prefix")
    return up[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netlab.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a lab and leave it up")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", help="per-host up and down limit, e.g. 50mbit")
    up.add_argument("--owner-pid", type=int, help="the lab is stale once this pid exits "
                    "(default: the shell that ran `up`)")
    down = sub.add_parser("down", help="remove a lab, or every stale one")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("--prefix")
    which.add_argument("--all-stale", action="store_true")
    for name in ("exec", "cut", "heal"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--prefix")
        cmd.add_argument("host")
        if name == "exec":
            cmd.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD ...")
    sub.add_parser("status", help="every lab with the project's prefix, as JSON")
    test = sub.add_parser("selftest", help="measure rate, cut and heal on a fresh lab")
    test.add_argument("--hosts", type=int, default=3)
    test.add_argument("--rate", default="50mbit")
    test.add_argument("--transfer-s", type=float, default=3.0)
    test.add_argument("--json-out", type=Path)
    sink = sub.add_parser("_sink")
    send = sub.add_parser("_send")
    for helper in (sink, send):
        helper.add_argument("--address", required=True)
        helper.add_argument("--port", type=int, required=True)
    sink.add_argument("--idle-timeout-s", type=float, required=True)
    sink.add_argument("--max-s", type=float, required=True)
    send.add_argument("--seconds", type=float, required=True)
    send.add_argument("--connect-timeout-s", type=float, required=True)
    return parser


def _command(args: argparse.Namespace) -> int:
    if args.command == "_sink":
        print(json.dumps(_serve_sink(args.address, args.port, args.idle_timeout_s, args.max_s)))
        return 0
    if args.command == "_send":
        print(json.dumps(_send(args.address, args.port, args.seconds, args.connect_timeout_s)))
        return 0
    reason = unavailable_reason()
    if reason is not None:
        print(f"netlab: {reason}", file=sys.stderr)
        return 2
    if args.command == "up":
        # `up` exits at once, so by default the lab belongs to the shell that asked for it.
        lab = Lab.create(args.hosts, rate=args.rate, owner_pid=args.owner_pid or os.getppid())
        print(json.dumps({"prefix": lab.prefix, "hosts": {h.name: h.address for h in lab.hosts}}))
    elif args.command == "down" and args.all_stale:
        print(json.dumps({"removed": destroy_stale()}))
    elif args.command == "down":
        Lab.attach(args.prefix).destroy()
    elif args.command == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            raise ValueError("exec needs a command: exec HOST -- CMD ...")
        host = Lab.attach(_resolve_prefix(args.prefix)).host(args.host)
        os.execvpe("ip", ["ip", "netns", "exec", host.namespace, *argv], _host_env(host))
    elif args.command in ("cut", "heal"):
        getattr(Lab.attach(_resolve_prefix(args.prefix)), args.command)(args.host)
    elif args.command == "status":
        prefixes = sorted(p.stem for p in STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []
        labs = [Lab.attach(p).status() for p in prefixes]
        print(json.dumps({"labs": labs, "stale": stale_prefixes()}, indent=2))
    elif args.command == "selftest":
        report = selftest(args.hosts, args.rate, transfer_s=args.transfer_s)
        print(json.dumps(report))
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        return 0 if selftest_passed(report) else 1
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
        print("netlab: interrupted; the lab it was building or testing is removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
