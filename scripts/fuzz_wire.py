#!/usr/bin/env python3
"""Wire fuzzer: mutated frames over real libp2p connections into a real node process, on every protocol it speaks.

It starts a victim node and an honest node (separate processes, loopback only), then sends
--frames mutated frames from fresh attacker identities: gossip RPCs whose messages are validly
signed but carry mutated Shoal envelopes (so they reach the node's validators), raw mutated
RPC frames, hello, manifest and shard requests, identify-push, ping, protocol negotiation
garbage and garbage after the Noise handshake. A banned attacker is replaced by a new one.

It reports JSON: frames sent by kind, identities used, whether the victim ever exited, its
peak RSS, whether the honest node still sees it alive, and the victim's drop counters. Exit
code 0 only when the victim never exited, still serves the honest peer and stops with 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from node.membership import ANNOUNCE_TOPIC, HELLO_PROTOCOL  # noqa: E402
from node.shardcast.service import MANIFEST_PROTOCOL, TOPIC as SHARDS_TOPIC  # noqa: E402
from node.shardcast.transfer import SHARD_PROTOCOL  # noqa: E402
from p2p.rawpeer import IDENTIFY_PUSH, MESHSUB, HostilePeer, RawPeerSession, multistream_line, varint  # noqa: E402
from protocol.codec import encode  # noqa: E402
from protocol.envelope import seal  # noqa: E402
from protocol.keys import Keypair  # noqa: E402
from protocol.manifest import Have, Haves, ManifestRequest, ShardRequest, build_manifest, seal_manifest  # noqa: E402
from protocol.messages import Announce, HardwareSummary  # noqa: E402
from protocol.spec_toml import load_spec_toml  # noqa: E402
from protocol.task import SPECS_TOPIC  # noqa: E402

READY_TIMEOUT_S = 180.0
OP_TIMEOUT_S = 3.0
PING = "/ipfs/ping/1.0.0"

# Share of frames by kind: gossip keeps its stream open, so it carries most of the volume.
MIX = {"gossip": 0.62, "rpc_raw": 0.08, "hello": 0.08, "manifest": 0.07, "shard": 0.07, "identify_push": 0.04,
       "ping": 0.02, "negotiation": 0.01, "after_noise": 0.01}


def seeds() -> dict[str, list[bytes]]:
    key = Keypair.from_label("fuzz-seed")
    hw = HardwareSummary(devices=("cpu",), memory_bytes=1 << 30, tflops=0.1)
    announce = Announce(peer_id=key.peer_id, seq=1, addrs=("/ip4/127.0.0.1/tcp/1",), version="0.1.0",
                        roles=("trainer",), hardware=hw, control="")
    spec = load_spec_toml((ROOT / "examples" / "tiny-task.toml").read_text(), created_ms=1)
    manifest = build_manifest(b"x" * 5000, shard_bytes=1024, label="fuzz")
    signed = seal_manifest(manifest, key)
    mid = signed.manifest_id
    have = Have(manifest_id=mid, num_shards=manifest.num_shards, bitfield=b"\xff")
    return {
        ANNOUNCE_TOPIC: [seal(announce, key)],
        SPECS_TOPIC: [seal(spec, key)],
        SHARDS_TOPIC: [signed.sealed, seal(have, key), seal(Haves(haves=(have,)), key)],
        "request": [encode(ManifestRequest(manifest_id=mid)), encode(ShardRequest(manifest_id=mid, index=0,
                                                                                 fallback=False))],
        "hello": [seal(announce, key)],
    }


def mutate(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    """One to four random edits: bit flips, byte sets, inserts, deletes, truncation, splices, repeats."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        n = len(out)
        if op == 0 and n:
            i = rng.randrange(n)
            out[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            out[rng.randrange(n)] = rng.choice((0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDD, rng.randrange(256)))
        elif op == 2:
            i = rng.randrange(n + 1)
            out[i:i] = rng.randbytes(rng.randint(1, 32))
        elif op == 3 and n > 1:
            i = rng.randrange(n)
            del out[i:i + rng.randint(1, max(1, n // 4))]
        elif op == 4 and n > 1:
            del out[rng.randrange(1, n):]
        elif op == 5 and others:
            other = rng.choice(others)
            i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
            out = out[:i] + other[j:]
        elif op == 6 and n:
            i = rng.randrange(n)
            out[i:i] = out[i:i + rng.randint(1, 64)] * rng.randint(2, 50)
        elif op == 7:
            out = bytearray(rng.randbytes(rng.randint(0, 600)))
        elif op == 8 and n >= 4:  # break a length prefix or a msgpack length field
            i = rng.randrange(min(n, 8))
            out[i] = rng.randrange(256)
    return bytes(out)


def framed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


class Fuzzer:
    def __init__(self, target: str, frames: int, rng: random.Random):
        self.target, self.frames, self.rng = target, frames, rng
        self.seeds = seeds()
        self.all_seeds = [s for group in self.seeds.values() for s in group]
        self.sent: dict[str, int] = {kind: 0 for kind in MIX}
        self.identities = 0
        self.total = 0

    def _kind(self) -> str:
        return self.rng.choices(list(MIX), weights=list(MIX.values()))[0]

    async def run(self, deadline_s: float, concurrency: int) -> None:
        async def attacker() -> None:
            while self.total < self.frames:
                await self._one_identity()

        with trio.move_on_after(deadline_s):
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(attacker)

    async def _one_identity(self) -> None:
        """One attacker identity until it is banned (or has sent its share): then a fresh one."""
        peer = HostilePeer(self.target)
        self.identities += 1
        session = RawPeerSession(peer)
        async with peer.host.run([]):
            try:
                await peer.connect()
            except Exception:
                await trio.sleep(0.05)  # refused: our last identity's ban, or the node is busy
                await peer.host.close()
                return
            gossip = None
            failures = 0
            for _ in range(2000):
                if self.total >= self.frames or failures >= 5:
                    break
                kind = self._kind()
                # Counted before the send: concurrent attackers must not overshoot --frames.
                self.sent[kind] += 1
                self.total += 1
                try:
                    with trio.fail_after(OP_TIMEOUT_S):
                        if kind == "gossip":
                            if gossip is None:
                                gossip = await session.open(MESHSUB)
                            topic = self.rng.choice([ANNOUNCE_TOPIC, SPECS_TOPIC, SHARDS_TOPIC])
                            seed = self.rng.choice(self.seeds[topic])
                            await gossip.write(session.gossip_frame(topic, mutate(self.rng, seed, self.all_seeds)))
                        else:
                            await self._stream_frame(session, peer, kind)
                    failures = 0
                except Exception:
                    failures += 1
                    gossip = None  # reset by the node (as it should be for junk), or we were banned
            with trio.move_on_after(2):
                await peer.host.close()

    async def _stream_frame(self, session: RawPeerSession, peer: HostilePeer, kind: str) -> None:
        rng = self.rng
        if kind == "after_noise":
            await peer.send_after_noise(rng.randbytes(rng.randint(1, 3000)), negotiate_yamux=rng.random() < 0.5)
            return
        if kind == "negotiation":
            stream = await peer.host.get_network().new_stream(peer.info.peer_id)
            await stream.write(multistream_line("/multistream/1.0.0") + mutate(rng, multistream_line(MESHSUB), []))
            await stream.reset()
            return
        protocol, payload = {
            "rpc_raw": lambda: (MESHSUB, mutate(rng, session.gossip_frame(
                ANNOUNCE_TOPIC, self.seeds[ANNOUNCE_TOPIC][0]), self.all_seeds)),
            "hello": lambda: (HELLO_PROTOCOL, mutate(rng, framed(self.seeds["hello"][0]), self.all_seeds)),
            "manifest": lambda: (MANIFEST_PROTOCOL, mutate(rng, framed(self.seeds["request"][0]), self.all_seeds)),
            "shard": lambda: (SHARD_PROTOCOL, mutate(rng, framed(self.seeds["request"][1]), self.all_seeds)),
            "identify_push": lambda: (IDENTIFY_PUSH, mutate(rng, varint(40) + rng.randbytes(40), [])),
            "ping": lambda: (PING, rng.randbytes(rng.choice((1, 31, 32, 33, 64, 500)))),
        }[kind]()
        stream = await session.open(protocol)
        await stream.write(payload)
        if rng.random() < 0.5:
            await stream.close()  # half-close: the node sees EOF mid-frame or after it
        else:
            await stream.reset()


# -- the node processes ---------------------------------------------------------------------------

def start_node(data_dir: Path, bootstrap: str | None = None) -> tuple[subprocess.Popen, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", SHOAL_HARDWARE_BENCHMARK="false",
               SHOAL_HEARTBEAT_INTERVAL_S="1", SHOAL_SUSPECT_AFTER_S="4", SHOAL_DEAD_AFTER_S="8")
    argv = [sys.executable, "-m", "node.cli", "start", "--data-dir", str(data_dir), "--listen",
            "/ip4/127.0.0.1/tcp/0", "--control-port", "0", "--no-mdns"]
    if bootstrap:
        argv += ["--bootstrap", bootstrap]
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "node.log", "ab")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        if not line and proc.poll() is not None:
            raise RuntimeError(f"node in {data_dir} exited with {proc.returncode}; see {data_dir / 'node.log'}")
        if line.startswith("shoal ready "):
            fields = dict(p.split("=", 1) for p in line.split()[2:] if "=" in p)
            return proc, {"peer_id": fields["peer_id"], "addr": fields["addrs"].split(",")[0]}
    proc.kill()
    raise RuntimeError(f"node in {data_dir} was not ready within {READY_TIMEOUT_S:.0f} s")


def cli_json(data_dir: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    done = subprocess.run([sys.executable, "-m", "node.cli", *args, "--data-dir", str(data_dir), "--json"],
                          capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=60)
    if done.returncode:
        raise RuntimeError(done.stderr.strip())
    return json.loads(done.stdout)


def rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident set size of a process, in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            values[line.split(":")[0]] = int(line.split()[1]) / 1024
    return round(values.get("VmRSS", 0.0), 1), round(values.get("VmHWM", 0.0), 1)


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    return proc.returncode


def alive_peers(data_dir: Path) -> list[str]:
    return [p["peer_id"] for p in cli_json(data_dir, "peers")["peers"] if p["state"] == "alive"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="stop sending after this long")
    parser.add_argument("--concurrency", type=int, default=6, help="attacker identities at once")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--work-dir", type=Path, help="node data and logs go here and stay (default: a temporary "
                        "folder, removed after a clean run)")
    args = parser.parse_args()
    if args.frames < 1:
        parser.error("--frames must be at least 1")

    if args.work_dir:
        if args.work_dir.exists() and not args.work_dir.is_dir():
            parser.error(f"--work-dir {args.work_dir} is a file, not a folder")
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="shoal-fuzz-"))
    victim_dir, honest_dir = work / "victim", work / "honest"
    victim, victim_info = start_node(victim_dir)
    honest, honest_info = start_node(honest_dir, bootstrap=victim_info["addr"])
    report: dict = {"frames_requested": args.frames, "seed": args.seed}
    try:
        rss_start, _ = rss_mb(victim.pid)
        fuzzer = Fuzzer(victim_info["addr"], args.frames, random.Random(args.seed))
        peak = [0.0]

        async def sample_rss() -> None:
            while victim.poll() is None:
                peak[0] = max(peak[0], rss_mb(victim.pid)[1])
                await trio.sleep(0.5)

        async def go() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_rss)
                started = time.monotonic()
                last = 0
                async with trio.open_nursery() as senders:
                    senders.start_soon(fuzzer.run, args.time_limit_s, args.concurrency)

                    async def progress() -> None:
                        nonlocal last
                        while True:
                            await trio.sleep(10)
                            rate = (fuzzer.total - last) / 10
                            last = fuzzer.total
                            print(f"fuzz: {fuzzer.total}/{args.frames} frames, {rate:.0f}/s, "
                                  f"{fuzzer.identities} identities, victim alive: {victim.poll() is None}",
                                  file=sys.stderr, flush=True)
                    nursery.start_soon(progress)
                report["seconds"] = round(time.monotonic() - started, 1)
                nursery.cancel_scope.cancel()

        trio.run(go)
        victim_running = victim.poll() is None
        # Give the honest peer a full dead-after period to show whether gossip still flows.
        time.sleep(9)
        honest_sees = victim_info["peer_id"] in alive_peers(honest_dir) if honest.poll() is None else False
        victim_sees = honest_info["peer_id"] in alive_peers(victim_dir) if victim.poll() is None else False
        status = cli_json(victim_dir, "status") if victim.poll() is None else {}
        rss_end, hwm = rss_mb(victim.pid) if victim.poll() is None else (0.0, 0.0)
        report.update({
            "frames_sent": fuzzer.total, "by_kind": fuzzer.sent, "identities": fuzzer.identities,
            "daemon_exits": 0 if victim_running else 1,
            "victim_rss_mb": {"start": rss_start, "end": rss_end, "peak": max(peak[0], hwm)},
            "honest_sees_victim_alive": honest_sees, "victim_sees_honest_alive": victim_sees,
            "victim_drops": status.get("messages", {}).get("dropped", {}),
            "victim_banned_peers": len(status.get("banned_peers", [])),
        })
    finally:
        report["victim_exit_code"] = stop(victim)
        report["honest_exit_code"] = stop(honest)
    ok = (report.get("daemon_exits") == 0 and report["victim_exit_code"] == 0
          and report.get("honest_sees_victim_alive") and report.get("victim_sees_honest_alive"))
    report["ok"] = bool(ok)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        args.json_out.write_text(text)
    if not args.work_dir and ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"node data and logs are in {work}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
