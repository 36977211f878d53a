"""The daemon's side of the trainer process: spawn it, send requests, await replies without blocking trio.

Deadlines belong to the caller (wrap calls in trio.fail_after). A call cancelled while the child
works kills the child, since its reply would answer a question nobody is asking any more; the
next call then raises TrainerCrashed until restart() starts a fresh one.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from protocol.errors import ShoalError

MAX_FRAME_BYTES = 1 << 20  # same cap as node.train.worker, which the daemon must not import (torch)
CLEANUP_S = 5.0
_PROJECT_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


class TrainerCrashed(ShoalError):
    """The trainer process died, broke the frame protocol, or was killed; call restart()."""


class TrainerRequestFailed(ShoalError):
    """The trainer refused or failed one request and is still running; str() is its error."""


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    samples: int
    steps: int
    losses: list[tuple[int, float]]
    seconds: float
    out_path: str
    carried_steps: int = 0
    """Of ``steps``, those taken ahead during the previous round's exchange (overlap)."""


def _as_map(value: Any) -> dict:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value)


class TrainerClient:
    def __init__(self, python: str, env: Mapping[str, str] | None):
        self._python = python
        self._env = dict(os.environ if env is None else env)
        self._env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, self._env.get("PYTHONPATH")) if p)
        self._process: trio.Process | None = None
        self._buffer = bytearray()
        self._lock = trio.Lock()
        self._ids = itertools.count(1)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        assert self._process is None, "start() on a running trainer; use restart()"
        self._buffer.clear()
        self._process = await trio.lowlevel.open_process(
            [self._python, "-m", "node.train.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self._env,
        )

    async def stop(self, *, graceful: bool = True) -> None:
        """Close stdin so the worker exits on EOF; kill it by pid if it has not within CLEANUP_S
        (at once when not graceful: a worker in the middle of a request would not read the EOF)."""
        process, self._process = self._process, None
        if process is None:
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CLEANUP_S if graceful else 0):
                await process.stdin.aclose()
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()  # after SIGKILL the wait is short
            await process.stdout.aclose()

    async def restart(self) -> None:
        async with self._lock:
            await self.stop()
            await self.start()

    async def _crashed(self, what: str) -> TrainerCrashed:
        process = self._process
        await self.stop(graceful=False)
        code = process.returncode if process is not None else None
        return TrainerCrashed(f"trainer process {process.pid if process else '?'} {what} (exit code {code})")

    async def _read_exact(self, size: int) -> bytes:
        process = self._process
        while len(self._buffer) < size:
            try:
                # None or closed: stopped under a request (the task ended while a check was asked of it).
                chunk = await process.stdout.receive_some(1 << 16) if process is not None else b""
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                chunk = b""
            if not chunk:
                raise await self._crashed("closed its stdout")
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    async def request(self, op: str, **fields: Any) -> dict:
        """Send one request and return its reply map; TrainerRequestFailed if it says ok: false."""
        async with self._lock:
            if not self.alive:
                raise TrainerCrashed("trainer process is not running; call restart()")
            rid = next(self._ids)
            payload = msgpack.packb({"op": op, "id": rid, **fields}, use_bin_type=True)
            if len(payload) > MAX_FRAME_BYTES:
                raise ValueError(f"request of {len(payload)} bytes is over the {MAX_FRAME_BYTES} byte cap")
            try:
                try:
                    await self._process.stdin.send_all(len(payload).to_bytes(4, "big") + payload)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    raise await self._crashed("stopped reading its stdin") from None
                size = int.from_bytes(await self._read_exact(4), "big")
                if size > MAX_FRAME_BYTES:
                    raise await self._crashed(f"sent a {size} byte frame, over the cap")
                try:
                    reply = msgpack.unpackb(await self._read_exact(size), raw=False)
                except ValueError as exc:
                    raise await self._crashed(f"sent an undecodable frame ({exc})") from None
            except trio.Cancelled:
                await self.stop(graceful=False)  # shielded; the child's work is abandoned with the caller
                raise
            if not isinstance(reply, dict) or reply.get("id") != rid:
                raise await self._crashed(f"answered request {rid} with {str(reply)[:80]!r}")
            if not reply.get("ok"):
                raise TrainerRequestFailed(f"trainer {op} failed: {reply.get('error')}")
            return reply

    async def ping(self) -> dict:
        return await self.request("ping")

    async def train(
        self,
        *,
        model: Any,
        base_path: str | os.PathLike,
        data_path: str | os.PathLike,
        shard_ranges: list[tuple[int, int]],
        steps: int,
        batch_size: int,
        seed: int,
        out_path: str | os.PathLike,
        adamw: Any = None,
        time_budget_s: float | None = None,
        opt_state_path: str | os.PathLike | None = None,
        opt_state_out: str | os.PathLike | None = None,
        log_every: int = 10,
        device: str = "auto",
        processes: int = 1,
        shard: bool = False,
        overlap: int = 0,
        carry: bool = False,
    ) -> TrainResult:
        """Train in the child; the pseudo-gradient base − trained lands in out_path (safetensors).

        ``overlap``: the child trains on after replying, up to that many steps or until the next request;
        ``carry``: this round takes those steps in (node/train/worker.py)."""
        reply = await self.request(
            "train",
            model=_as_map(model),
            base_path=os.fspath(base_path),
            data_path=os.fspath(data_path),
            shard_ranges=[[int(s), int(e)] for s, e in shard_ranges],
            steps=steps,
            batch_size=batch_size,
            seed=seed,
            out_path=os.fspath(out_path),
            adamw=_as_map(adamw) if adamw is not None else {},
            time_budget_s=time_budget_s,
            opt_state_path=os.fspath(opt_state_path) if opt_state_path is not None else None,
            opt_state_out=os.fspath(opt_state_out) if opt_state_out is not None else None,
            log_every=log_every,
            device=device,
            processes=processes,
            shard=shard,
            overlap=overlap,
            carry=carry,
        )
        return TrainResult(
            samples=reply["samples"],
            steps=reply["steps"],
            losses=[(int(s), float(v)) for s, v in reply["losses"]],
            seconds=reply["seconds"],
            out_path=reply["out_path"],
            carried_steps=int(reply.get("carried_steps", 0)),
        )

    async def evaluate(
        self,
        *,
        model: Any,
        weights_path: str | os.PathLike,
        data_path: str | os.PathLike,
        data_range: tuple[int, int],
        num_batches: int,
        seed: int,
        batch_size: int = 8,
        device: str = "auto",
    ) -> float:
        """Mean held-out cross-entropy (nats per byte) of the weights in weights_path."""
        reply = await self.request(
            "eval",
            model=_as_map(model),
            weights_path=os.fspath(weights_path),
            data_path=os.fspath(data_path),
            data_range=[int(data_range[0]), int(data_range[1])],
            num_batches=num_batches,
            seed=seed,
            batch_size=batch_size,
            device=device,
        )
        return float(reply["loss"])


@asynccontextmanager
async def open_trainer(python: str = sys.executable, env: Mapping[str, str] | None = None) -> AsyncIterator[TrainerClient]:
    """A running trainer child for the duration of the block; stopped (then killed) on exit."""
    client = TrainerClient(python, env)
    await client.start()
    try:
        yield client
    finally:
        await client.stop()
