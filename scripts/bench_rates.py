#!/usr/bin/env python3
"""Single-stream rates between two processes on this machine: plain TCP, one libp2p stream, the shard protocol.

Each measurement runs a serving worker and a client worker (this file, run as a module); the
client prints its timings as one JSON line. Data flows server -> client in every case, and the
client's clock runs from opening the stream (or asking for the manifest) to the last byte.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.local_swarm import stop  # noqa: E402

STREAM_PROTOCOL = "/shoal/bench-stream/1"
CHUNK_BYTES = 1 << 20
READY_TIMEOUT_S = 120.0
WORKER_TIMEOUT_S = 600.0
SOCKET_TIMEOUT_S = 30.0


def _payload() -> bytes:
    # One random MiB, sent over and over: the rate under test must not include generating data.
    return os.urandom(CHUNK_BYTES)


# plain TCP

def _tcp_serve(args: argparse.Namespace) -> None:
    payload = _payload()
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(SOCKET_TIMEOUT_S)
        print(f"ready {server.getsockname()[1]}", flush=True)
        for _ in range(args.reps):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(SOCKET_TIMEOUT_S)
                nbytes = int.from_bytes(_recv_exactly(conn, 8), "big")
                view = memoryview(payload)
                sent = 0
                while sent < nbytes:
                    n = min(CHUNK_BYTES, nbytes - sent)
                    conn.sendall(view[:n])
                    sent += n
                conn.shutdown(socket.SHUT_WR)
                _recv_exactly(conn, 1)


def _recv_exactly(conn: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = conn.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("peer closed early")
        data += chunk
    return data


def _tcp_client(args: argparse.Namespace) -> None:
    seconds = []
    buf = bytearray(CHUNK_BYTES)
    for _ in range(args.reps):
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", int(args.connect)), timeout=SOCKET_TIMEOUT_S) as conn:
            conn.sendall(args.bytes.to_bytes(8, "big"))
            got = 0
            while n := conn.recv_into(buf):
                got += n
            seconds.append(time.perf_counter() - start)
            conn.sendall(b"k")
        assert got == args.bytes, f"received {got} of {args.bytes} bytes"
    print(json.dumps({"seconds": seconds}), flush=True)


# one libp2p stream

async def _wait_stdin_eof() -> None:
    import trio
    # The parent closes our stdin when it is done with us.
    await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


async def _stream_serve(args: argparse.Namespace) -> None:
    from p2p.host import open_host
    from protocol.keys import Keypair
    payload = _payload()

    async def serve(stream) -> None:
        nbytes = int.from_bytes(await stream.read(8), "big")
        sent = 0
        while sent < nbytes:
            n = min(CHUNK_BYTES, nbytes - sent)
            await stream.write(payload if n == CHUNK_BYTES else payload[:n])
            sent += n
        await stream.close_write()
        await stream.read(1)  # the ack: yamux drops unread data if we close the connection first

    async with open_host(Keypair(os.urandom(32))) as host:
        host.set_stream_handler(STREAM_PROTOCOL, serve)
        print(f"ready {host.listen_addrs()[0]}", flush=True)
        await _wait_stdin_eof()


async def _stream_client(args: argparse.Namespace) -> None:
    import trio

    from p2p.host import open_host
    from protocol.keys import Keypair
    seconds = []
    async with open_host(Keypair(os.urandom(32))) as host:
        with trio.fail_after(WORKER_TIMEOUT_S):
            peer = await host.connect(args.connect)
            for _ in range(args.reps):
                start = trio.current_time()
                stream = await host.open_stream(peer, STREAM_PROTOCOL)
                await stream.write(args.bytes.to_bytes(8, "big"))
                got = 0
                while chunk := await stream.read(CHUNK_BYTES):
                    got += len(chunk)
                seconds.append(trio.current_time() - start)
                await stream.write(b"k")
                await stream.close()
                assert got == args.bytes, f"received {got} of {args.bytes} bytes"
    print(json.dumps({"seconds": seconds}), flush=True)


# the shard protocol (ShardcastService, one publisher and one receiver)

def _shard_config(args: argparse.Namespace):
    from node.shardcast import ShardcastConfig
    return ShardcastConfig(shard_bytes=args.shard_bytes, keep_manifests=args.reps + 1)


async def _shard_serve(args: argparse.Namespace) -> None:
    import trio

    from node.shardcast import ShardcastService, ShardStore
    from p2p.host import open_host
    from protocol.keys import Keypair
    from protocol.manifest import manifest_id
    work = Path(args.dir)
    kp = Keypair(os.urandom(32))
    async with open_host(kp) as host:
        store = await trio.to_thread.run_sync(ShardStore.open, work / "publisher")
        svc = ShardcastService(host, kp, store, config=_shard_config(args))
        async with trio.open_nursery() as nursery:
            await nursery.start(svc.run)
            ids = []
            for rep in range(args.reps):
                # Fresh content per repetition: the receiver must not already hold any shard.
                src = work / f"source{rep}.bin"
                await trio.to_thread.run_sync(_write_random, src, args.bytes)
                ids.append(manifest_id(await svc.publish_file(src)).hex())
            print(f"ready {host.listen_addrs()[0]} {','.join(ids)}", flush=True)
            await _wait_stdin_eof()
            nursery.cancel_scope.cancel()


def _write_random(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        for start in range(0, nbytes, CHUNK_BYTES):
            f.write(os.urandom(min(CHUNK_BYTES, nbytes - start)))


class _UnstoredWriter:
    """A shard writer that only counts: the shard protocol's own cost, without hashing or writing what arrives."""

    def __init__(self, store, sha256: bytes, nbytes: int):
        self._store, self.sha256, self.nbytes, self.received_bytes = store, sha256, nbytes, 0

    def write_all(self, chunks) -> None:
        self.received_bytes += sum(len(c) for c in chunks)

    def verify(self) -> None:
        if self.received_bytes != self.nbytes:
            raise ValueError(f"shard has {self.received_bytes} bytes, expected {self.nbytes}")

    def commit(self) -> None:
        self.verify()
        self._store._shards[self.sha256] = self.nbytes  # counted as held, so the fetch sees it done

    def abort(self) -> None:
        pass


def _unstored_store(path: Path):
    from node.shardcast import ShardStore

    class UnstoredStore(ShardStore):
        def shard_writer(self, sha256: bytes, nbytes: int) -> _UnstoredWriter:
            return _UnstoredWriter(self, sha256, nbytes)

    return UnstoredStore.open(path)


async def _shard_client(args: argparse.Namespace) -> None:
    import trio

    from node.shardcast import ShardcastService, ShardStore
    from p2p.host import open_host
    from protocol.keys import Keypair
    addr, ids = args.connect.split(" ")
    kp = Keypair(os.urandom(32))
    seconds = []
    async with open_host(kp) as host:
        opener = _unstored_store if args.unstored else ShardStore.open
        store = await trio.to_thread.run_sync(opener, Path(args.dir) / "receiver")
        svc = ShardcastService(host, kp, store, config=_shard_config(args))
        async with trio.open_nursery() as nursery:
            await nursery.start(svc.run)
            with trio.fail_after(WORKER_TIMEOUT_S):
                await host.connect(addr)
                for mid in ids.split(","):
                    start = trio.current_time()
                    m = await svc.fetch(bytes.fromhex(mid))
                    seconds.append(trio.current_time() - start)
                    assert m.total_bytes == args.bytes
            nursery.cancel_scope.cancel()
    print(json.dumps({"seconds": seconds}), flush=True)


# the parent side

def _worker_argv(role: str, **options) -> list[str]:
    argv = [sys.executable, "-m", "scripts.bench_rates", role]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def _read_ready(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline().strip()
            if line.startswith("ready "):
                return line[len("ready "):]
            if not line and proc.poll() is not None:
                break
    raise RuntimeError(f"{proc.args[3]} worker not ready (exit code {proc.poll()})")


def measure(kind: str, *, nbytes: int, reps: int, work_dir: Path, shard_bytes: int = 0) -> list[float]:
    """MB/s of each repetition of ``kind``, server and client in two processes: "tcp", "stream", "shard", or
    "shard_unstored" (the shard protocol with a receiver that neither hashes nor writes: what storing costs)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    common = dict(bytes=nbytes, reps=reps, dir=work_dir, shard_bytes=shard_bytes)
    unstored = kind == "shard_unstored"
    kind = "shard" if unstored else kind
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(work_dir / f"{kind}.log", "ab")
    server = subprocess.Popen(_worker_argv(f"{kind}-serve", **common), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=env,
                              start_new_session=True)
    try:
        target = _read_ready(server, READY_TIMEOUT_S)
        argv = _worker_argv(f"{kind}-client", connect=target, **common) + (["--unstored"] if unstored else [])
        client = subprocess.run(argv, stdout=subprocess.PIPE,
                                stderr=log, text=True, cwd=ROOT, env=env, timeout=WORKER_TIMEOUT_S)
        if client.returncode != 0:
            raise RuntimeError(f"{kind} client failed (exit code {client.returncode}); see {log.name}")
        seconds = json.loads(client.stdout.strip().splitlines()[-1])["seconds"]
    finally:
        server.stdin.close()
        stop([server])
        log.close()
    return [nbytes / 1e6 / s for s in seconds]


def median_mb_s(rates: list[float]) -> float:
    return round(statistics.median(rates), 1)


_WORKERS = {"tcp-serve": _tcp_serve, "tcp-client": _tcp_client, "stream-serve": _stream_serve,
            "stream-client": _stream_client, "shard-serve": _shard_serve, "shard-client": _shard_client}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=sorted(_WORKERS))
    parser.add_argument("--connect", default="")
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--dir", default=".")
    parser.add_argument("--shard-bytes", type=int, default=0)
    parser.add_argument("--unstored", action="store_true", help="shard client: count what arrives, store nothing")
    args = parser.parse_args(argv)
    worker = _WORKERS[args.role]
    if args.role.startswith("tcp"):
        worker(args)
    else:
        import trio
        trio.run(worker, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
