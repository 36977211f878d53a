"""Hole punching behind netlab NATs: DCUtR success rate per NAT pair, time to a direct connection, relayed vs direct bytes.

For each NAT pair, one lab: a public relay node and two private nodes, each behind its own router.
The dialer connects to the listener through its relayed address, the hosts' DCUtR tries to punch a
direct connection, and the dialer records whether and when one appeared; then it disconnects, the
routers forget the pair's mappings, and the next attempt starts fresh. After each attempt the dialer
sends a small control message (which may use the relay) and a bulk payload on a direct-only protocol
(which must not). The libp2p measurement study of DCUtR (arXiv:2510.27500) is the anchor: ~70%.

    sudo .venv/bin/python scripts/bench_nat.py [--attempts 50] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import netlab, netlab_nat  # noqa: E402

PAIRS = {
    "full_cone": ("full_cone", "full_cone"),
    "port_restricted": ("port_restricted", "port_restricted"),
    "symmetric": ("port_restricted", "symmetric"),
    "symmetric_to_full_cone": ("full_cone", "symmetric"),
}
"""Result key -> the (listener, dialer) homes' NAT kinds."""
ANCHOR_SUCCESS_RATE = 0.70
PORT = 4001
PUNCH_DEADLINE_S = 10.0
"""An attempt without a direct connection by then counts as failed (successes here take 1-6 s)."""
SETUP_TIMEOUT_S = 90.0
CONTROL_PROTOCOL = "/shoal-bench/control/1"
BULK_PROTOCOL = "/shoal-bench/bulk/1"
CONTROL_BYTES = 1024
BULK_BYTES = 256 * 1024
RELAYED_DIAL_RETRIES = 3


# -- roles, each run inside a netlab host ---------------------------------------------------------

def _role(args: argparse.Namespace) -> int:
    import trio

    from p2p.api import HostConfig
    from p2p.host import open_host
    from protocol.errors import TransportError
    from protocol.keys import Keypair

    def config_for(port: int) -> HostConfig:
        return HostConfig(listen_addrs=[f"/ip4/0.0.0.0/tcp/{port}"], nat=True, relay_service=True,
                          direct_only_protocols=(BULK_PROTOCOL,), dial_timeout_s=5.0, stream_open_timeout_s=5.0)

    def say(**fields) -> None:
        print(json.dumps(fields), flush=True)

    async def sink(stream) -> None:
        while await stream.read(1 << 16):
            pass
        await stream.write(b"ok")
        await stream.close()

    async def send(host, peer: str, protocol: str, num_bytes: int) -> bool:
        try:
            with trio.fail_after(20):
                stream = await host.open_stream(peer, protocol)
                await stream.write(bytes(num_bytes))
                await stream.close_write()
                ok = await stream.read(2) == b"ok"
                await stream.close()
                return ok
        except (TransportError, trio.TooSlowError):
            return False

    async def wait_private(host, need_relay: bool) -> None:
        with trio.fail_after(SETUP_TIMEOUT_S):
            while not (host.reachability().status == "private" and (host.reachability().relay_addrs or not need_relay)):
                await trio.sleep(0.1)

    async def serve(role: str) -> None:
        async with open_host(Keypair.from_label(f"bench-nat-{role}"), config_for(PORT)) as host:
            host.set_stream_handler(CONTROL_PROTOCOL, sink)
            host.set_stream_handler(BULK_PROTOCOL, sink)
            if role == "relay":
                say(addr=f"/ip4/{args.address}/tcp/{PORT}/p2p/{host.peer_id}")
                await trio.sleep_forever()
            await host.connect(args.relay)
            await wait_private(host, need_relay=True)
            say(peer_id=host.peer_id, relay_addrs=list(host.reachability().relay_addrs))
            # Tell the driver whenever the dialer is gone, so the next attempt starts from nothing.
            was_connected = False
            while True:
                connected = len(host.connected_peers()) > 1  # the relay, and the dialer while it is here
                if was_connected and not connected:
                    say(dialer_gone=True)
                was_connected = connected
                await trio.sleep(0.05)

    async def attempt_once(attempt: int) -> dict:
        """A fresh dialer (key and port) per attempt: a real pair meets once, with no leftover TCP state."""
        async with open_host(Keypair.from_label(f"bench-nat-dialer-{attempt}"), config_for(PORT + 1 + attempt)) as host:
            await host.connect(args.relay)
            await wait_private(host, need_relay=False)  # identify has told DCUtR our observed address by now
            started = trio.current_time()
            peer, retries, error = None, 0, ""
            while peer is None and retries <= RELAYED_DIAL_RETRIES:
                try:
                    peer = await host.connect(args.target)
                except TransportError as exc:
                    retries, error = retries + 1, str(exc)
                    await trio.sleep(0.5)
            if peer is None:
                return {"attempt": attempt, "relayed": False, "direct": False, "retries": retries, "error": error}
            relayed_ok = await send(host, peer, CONTROL_PROTOCOL, CONTROL_BYTES)
            direct_s = None
            with trio.move_on_after(PUNCH_DEADLINE_S):
                while not host.is_direct(peer):
                    await trio.sleep(0.05)
                direct_s = trio.current_time() - started
            bulk_ok = await send(host, peer, BULK_PROTOCOL, BULK_BYTES)
            stats = host.statistics()
            return {"attempt": attempt, "relayed": relayed_ok, "direct": direct_s is not None, "direct_s": direct_s,
                    "retries": retries, "bulk_sent": bulk_ok, "relayed_bytes": stats.relayed_bytes_by_protocol,
                    "bytes_sent": stats.bytes_sent, "refused": stats.relayed_streams_refused}

    async def main() -> None:
        if args.role != "dialer":
            await serve(args.role)
            return
        say(ready=True)
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        for attempt in range(args.attempts):
            try:
                say(**await attempt_once(attempt))
            except trio.TooSlowError:
                say(attempt=attempt, relayed=False, direct=False, error="the dialer never learned it is private")
            await stdin.receive_some(64)  # the driver has seen the listener drop us and flushed the routers

    trio.run(main)
    return 0


# -- the driver -------------------------------------------------------------------------------------

def _forget_pair(lab: netlab_nat.NatLab) -> None:
    """Drop conntrack state between the two homes (not their relay connections) and the full-cone sets."""
    public = [home["public_address"] for home in lab.homes]
    for home, other in zip(lab.homes, reversed(public)):
        router = lab.host(home["router"]).namespace
        netlab._run(["ip", "netns", "exec", router, "conntrack", "-D", "-d", other], check=False)
        netlab._run(["ip", "netns", "exec", router, "conntrack", "-D", "-s", other], check=False)
        netlab._run(["ip", "netns", "exec", router, "nft", "flush", "set", "ip", "shoalnat", "mapped"])


def _start(lab, host: str, *role_args: str) -> subprocess.Popen:
    argv = [sys.executable, str(Path(__file__).resolve()), "_role", *role_args]
    return subprocess.Popen(lab.argv_in(host, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=str(ROOT),
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _line(proc: subprocess.Popen, what: str) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the {what} exited before reporting (rc {proc.wait()})")
    return json.loads(line)


def bench_pair(name: str, kinds: tuple[str, str], attempts: int) -> dict:
    procs: list[subprocess.Popen] = []
    with netlab_nat.open_nat_lab(1, list(kinds)) as lab:
        for home in lab.homes:  # the dialer reuses its listen port for every punch
            lab.run(home["host"], ["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])
        try:
            relay = _start(lab, "h0", "relay", "--address", lab.hosts[0].address)
            procs.append(relay)
            relay_addr = _line(relay, "relay")["addr"]
            listener = _start(lab, "p0", "listener", "--relay", relay_addr)
            procs.append(listener)
            target = _line(listener, "listener")["relay_addrs"][0]
            dialer = _start(lab, "p1", "dialer", "--relay", relay_addr, "--target", target,
                            "--attempts", str(attempts))
            procs.append(dialer)
            _line(dialer, "dialer")
            results = []
            for _ in range(attempts):
                results.append(_line(dialer, "dialer"))
                print(f"bench_nat: {name} {json.dumps(results[-1])}", file=sys.stderr, flush=True)
                if results[-1].get("relayed") is not None and "error" not in results[-1]:
                    _line(listener, "listener")  # the listener has dropped the dialer too
                _forget_pair(lab)
                dialer.stdin.write("next\n")
                dialer.stdin.flush()
        finally:
            from scripts.local_swarm import stop
            stop(procs)
    direct = [r for r in results if r.get("direct")]
    times = sorted(r["direct_s"] for r in direct)
    relayed: dict[str, int] = {}
    for r in results:
        for protocol, n in r.get("relayed_bytes", {}).items():
            relayed[protocol] = relayed.get(protocol, 0) + n
    return {
        "nat": {"listener": kinds[0], "dialer": kinds[1]}, "attempts": len(results),
        "success_rate": round(len(direct) / len(results), 3) if results else 0.0,
        "relayed_control_ok": sum(1 for r in results if r.get("relayed")),
        "relayed_dial_retries": sum(r.get("retries", 0) for r in results),
        "time_to_direct_s": {"median": round(statistics.median(times), 2), "max": round(times[-1], 2)} if times else None,
        "bulk_sent_direct": sum(1 for r in results if r.get("bulk_sent")),
        "relayed_bytes_by_protocol": relayed, "relayed_shard_bytes": relayed.get(BULK_PROTOCOL, 0),
        "bytes_sent": sum(r.get("bytes_sent", 0) for r in results),
        "bulk_refused_over_relay": sum(r.get("refused", 0) for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempts", type=int, default=50)
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, from {', '.join(PAIRS)}")
    parser.add_argument("--json-out", type=Path)
    sub = parser.add_subparsers(dest="command")
    role = sub.add_parser("_role")
    role.add_argument("role", choices=("relay", "listener", "dialer"))
    role.add_argument("--address", default="")
    role.add_argument("--relay", default="")
    role.add_argument("--target", default="")
    role.add_argument("--attempts", type=int, default=50)
    args = parser.parse_args(argv)
    if args.command == "_role":
        return _role(args)
    reason = netlab_nat.nat_unavailable_reason() or (
        None if shutil.which("conntrack") else "bench_nat needs conntrack on PATH (apt-get install conntrack)")
    if reason:
        print(f"bench_nat: {reason}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.pairs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PAIRS]
    if unknown or args.attempts < 1:
        print(f"bench_nat: unknown pair(s) {unknown}; choose from {', '.join(PAIRS)}" if unknown
              else "bench_nat: --attempts must be at least 1", file=sys.stderr)
        return 2
    netlab.destroy_stale()
    report: dict = {}
    errors: dict = {}
    started = time.monotonic()

    def run_one(name: str) -> None:
        try:
            report[name] = bench_pair(name, PAIRS[name], args.attempts)
        except Exception as exc:  # one pair's failure is reported, the others still run
            errors[name] = repr(exc)

    # The pairs run side by side: a failed attempt mostly waits, so this costs little CPU.
    threads = [threading.Thread(target=run_one, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {name: report[name] for name in names if name in report}
    out["relayed_shard_bytes"] = sum(r["relayed_shard_bytes"] for r in report.values())
    out["anchor_success_rate"] = ANCHOR_SUCCESS_RATE
    out["seconds"] = round(time.monotonic() - started, 1)
    if errors:
        out["errors"] = errors
    text = json.dumps(out, indent=1)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
