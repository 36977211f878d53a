"""The trainer child process: length-prefixed msgpack requests on stdin, replies on stdout.

Frame: 4-byte big-endian length, then a msgpack map, at most MAX_FRAME_BYTES. Tensors never
cross the pipe, only file paths. Requests (every one carries an "id", echoed in the reply):

    {"op": "ping"} -> {"ok": true, "pid", "torch"}
    {"op": "train", "model": {n_layer, n_head, d_model, seq_len, dropout?}, "base_path",
     "data_path", "shard_ranges": [[start, end], ...], "steps", "batch_size", "seed",
     "out_path", "time_budget_s"?: float|None, "adamw"?: {lr, beta1, beta2, eps, weight_decay,
     warmup_steps, grad_clip}, "opt_state_path"?: str|None, "opt_state_out"?: str|None,
     "log_every"?: int, "overlap"?: int,
     "carry"?: bool, "processes"?: int, "shard"?: bool}
      -> {"ok": true, "samples", "steps", "losses": [[step, loss], ...], "seconds",
          "carried_steps", "out_path"}
    {"op": "eval", "model", "weights_path", "data_path", "data_range": [start, end],
     "num_batches", "batch_size", "seed"} -> {"ok": true, "loss"}
    {"op": "gain", ...} -> {"ok": true, "gain", "loss", "seconds"}: an hf update's own-data gain, for the
     training checks (node/train/recipes.py); for tiny-lm -> {"ok": true, "gains": {producer or owner: float},
     "seconds"}, its own gain and its advantage over near copies' owners (node/train/check.py)

train writes the pseudo-gradient Δ = base − trained (float32, named, safetensors) to out_path,
since Δ is what the round compresses and ships. Nothing is hashed here: the daemon knows the
base's hash (it wrote the file), and Δ is hashed once, as the slices it is encoded into. If
opt_state_path is given, the AdamW state is read from it when the file exists and written after
training to opt_state_out (default: back to opt_state_path), so a peer's inner optimizer carries
across rounds; a node that keeps one file per round retrains a round after a restart from the
same state as the first time. Shard ranges are byte ranges of data_path, concatenated in the
order given.

With "overlap" (a number of steps), the worker keeps training on the same data after it replies,
until the next request arrives or that many steps are taken (the round's exchange runs meanwhile).
A train request with "carry" for the same optimizer state, model and batch moves those steps onto
its base (θ_local ← base + (θ_local − where they started)) and takes only the rest of its steps;
its reply counts the carried steps, their losses and their seconds. Without "carry", or after a
restart, they are dropped and the round trains from its base as usual.

A request that fails gets {"ok": false, "error": "<Type>: <message>"} and the worker keeps
serving. EOF on stdin at a frame boundary exits 0. Progress lines go to stderr.
"""

from __future__ import annotations

import functools
import io
import os
import select
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgpack

MAX_FRAME_BYTES = 1 << 20
_HEADER_BYTES = 4


def read_frame(stream: BinaryIO, max_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """One frame's payload, or None at EOF on a frame boundary; EOFError if cut mid-frame."""
    header = stream.read(_HEADER_BYTES)
    if not header:
        return None
    if len(header) < _HEADER_BYTES:
        raise EOFError("stdin ended inside a frame header")
    size = int.from_bytes(header, "big")
    if size > max_bytes:
        _discard(stream, size)
        raise ValueError(f"frame of {size} bytes is over the {max_bytes} byte cap")
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError("stdin ended inside a frame")
    return payload


def _discard(stream: BinaryIO, size: int) -> None:
    while size > 0:
        chunk = stream.read(min(size, 1 << 16))
        if not chunk:
            raise EOFError("stdin ended inside an oversize frame")
        size -= len(chunk)


def encode_frame(message: dict) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"reply of {len(payload)} bytes is over the {MAX_FRAME_BYTES} byte cap")
    return len(payload).to_bytes(_HEADER_BYTES, "big") + payload


def decode_frame(payload: bytes) -> dict:
    message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(message, dict):
        raise ValueError(f"a request is a msgpack map, got {type(message).__name__}")
    return message


def _field(req: dict, name: str, kind: type | tuple[type, ...], default=...):
    value = req.get(name)
    if value is None:
        if default is ...:
            raise ValueError(f"request is missing {name!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"request field {name!r} has the wrong type {type(value).__name__}")
    return value


def _log(message: str) -> None:
    print(f"[trainer {os.getpid()}] {message}", file=sys.stderr, flush=True)


def handle_train(req: dict) -> dict:
    """One round's inner steps; with "processes" > 1, over that many local ranks (node/train/ranks.py)."""
    from node.train.inner import resolve_device
    from node.train.ranks import run_ranks, usable_processes

    device = resolve_device(_field(req, "device", str, "auto"))
    asked = _field(req, "processes", int, 1)
    world = usable_processes(asked, _field(req, "batch_size", int), device.type == "cuda")
    if world > 1:
        if _recipes().is_hf(_field(req, "model", dict)):
            from node.train import hf
            hf.forget()  # each rank builds its own on its device: no idle copy in this process beside them
        shard = req.get("shard") is True
        _log(f"train id={req.get('id')}: {world} processes ({'NCCL on CUDA' if device.type == 'cuda' else 'gloo'}"
             f"{', the model sharded (FSDP)' if shard else ''})")
        return run_ranks(world, functools.partial(_train_rank, req), cuda=device.type == "cuda", shard=shard)
    if asked > 1:
        _log(f"train id={req.get('id')}: one process (asked for {asked}; the devices or the batch do not split)")
    return _train(req, device, None)


def _train_rank(req: dict, ranks) -> dict:
    return _train(req, ranks.device, ranks)


def _train(req: dict, device, ranks) -> dict:
    from node.train.data import read_ranges
    from node.train.diloco import load_named, pseudo_gradient, save_named
    from node.train.inner import AdamWConfig, InnerLoop, train_inner
    from node.train.model import ModelConfig
    from node.train.ranks import device_label

    global _carry
    rid = req.get("id")
    lead = ranks is None or ranks.rank == 0

    def progress(step: int, loss: float) -> None:
        if lead:
            _log(f"train id={rid} step {step}/{req.get('steps')} loss {loss:.4f}")

    carry, _carry = _carry, None
    if _recipes().is_hf(_field(req, "model", dict)):
        return _recipes().train(req, device=device, progress=progress, ranks=ranks)
    config = ModelConfig.from_dict(_field(req, "model", dict))
    adamw = AdamWConfig.from_dict(_field(req, "adamw", dict, {}))
    base = load_named(_field(req, "base_path", str))
    data = read_ranges(_field(req, "data_path", str), req.get("shard_ranges"))
    steps = _field(req, "steps", int)
    budget = _field(req, "time_budget_s", (int, float), None)
    opt_path = _field(req, "opt_state_path", str, None)
    opt_out = _field(req, "opt_state_out", str, opt_path)
    out_path = _field(req, "out_path", str)
    batch_size = _field(req, "batch_size", int)
    key = _carry_key(opt_out, config)
    if carry is not None and not (req.get("carry") is True and ranks is None and carry.key == key
                                  and carry.batch_size == batch_size and carry.steps <= steps):
        carry = None  # another task's, or more steps than this round may claim: trained from its base as usual
    if carry is not None:
        loop = carry.loop
        loop.rebase(base, carry.sent)
        _log(f"train id={rid}: {carry.steps} steps taken during the last exchange carried into this round")
    else:
        opt_state = load_named(opt_path) if opt_path and os.path.exists(opt_path) else None
        loop = InnerLoop(model_config=config, weights=base, adamw=adamw, opt_state=opt_state, device=device,
                         ranks=ranks)
        carry = Carry(key=key, loop=loop, batch_size=batch_size)
    remaining = steps - carry.steps
    if remaining >= 1:
        result = train_inner(model_config=config, base_weights=base, data=data, steps=remaining,
                             batch_size=batch_size, seed=_field(req, "seed", int), adamw=adamw, time_budget_s=budget,
                             log_every=_field(req, "log_every", int, 10), progress=progress, device=device,
                             ranks=ranks, loop=loop)
        weights, opt_state, done, seconds = result.weights, result.opt_state, result.steps, result.seconds
        losses = [(carry.steps + s, x) for s, x in result.losses]
    else:  # the exchange outlasted a whole round of steps: those are the update
        weights, opt_state, done, seconds, losses = loop.weights(), loop.opt_state(), 0, 0.0, []
    if not lead:
        return {}
    delta = pseudo_gradient(base, weights)
    save_named(out_path, delta)
    if opt_out:
        save_named(opt_out, opt_state)
    ahead = min(steps, _field(req, "overlap", int, 0))
    if ahead > 0 and ranks is None:
        # Keep training on this round's data while the daemon exchanges the update (serve() steps it
        # between requests); the next round's request carries those steps in.
        _carry = Carry(key=carry.key, loop=loop, batch_size=batch_size, sent=weights, limit=ahead,
                       log_every=_field(req, "log_every", int, 10))
    total = carry.steps + done
    return {
        "samples": total * batch_size,
        "steps": total,
        "losses": [[s, x] for s, x in carry.losses + losses],
        "seconds": carry.seconds + seconds,
        "carried_steps": carry.steps,
        "out_path": out_path,
        "device": device_label(device, ranks),
    }


def _carry_key(opt_out: str | None, config) -> tuple:
    """Where the optimizer state lives (a task's directory, whichever round's file) and the model config."""
    return (os.path.dirname(opt_out) if opt_out else None, config)


@dataclass(kw_only=True)
class Carry:
    """Inner steps taken between requests (task option overlap), to be carried into the next round."""

    key: tuple
    """(the optimizer state's directory, the model config): the task and model the steps belong to."""
    loop: Any
    batch_size: int
    sent: dict | None = None
    """The weights the last update was computed to: the next round rebases the steps taken since."""
    limit: int = 0
    """At most this many steps are taken ahead (the task's overlap share of a round's steps)."""
    log_every: int = 10
    steps: int = 0
    seconds: float = 0.0
    losses: list = field(default_factory=list)


_carry: Carry | None = None


def _pending(stream: BinaryIO) -> bool:
    """Whether a request (or EOF) waits on ``stream``; True where that cannot be told (no real pipe)."""
    try:
        return bool(select.select([stream.fileno()], [], [], 0)[0])
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return True


def _step_ahead(stdin: BinaryIO) -> None:
    """Train on until the next request arrives or a round's steps are taken: the overlap of a round's
    exchange with the next round's training. The caller's client waits for each reply before it sends
    the next request, so nothing is buffered unread when this looks at the pipe."""
    global _carry
    c = _carry
    if c is None or c.steps >= c.limit or _pending(stdin):
        return
    started = time.monotonic()
    first = c.steps
    try:
        while c.steps < c.limit and not _pending(stdin):
            loss = c.loop.step()
            if c.steps % c.log_every == 0:
                c.losses.append((c.steps, loss.item()))
            c.steps += 1
    except Exception:  # the next round then trains from its weights as without overlap
        _log(f"training ahead failed; the next round starts afresh:\n{traceback.format_exc()}")
        _carry = None
        return
    finally:
        c.seconds += time.monotonic() - started
    _log(f"took {c.steps - first} steps ahead while the round's exchange ran ({c.steps}/{c.limit})")


def handle_eval(req: dict) -> dict:
    from node.train.data import read_ranges
    from node.train.diloco import load_named
    from node.train.inner import evaluate, resolve_device
    from node.train.model import ModelConfig

    if _recipes().is_hf(_field(req, "model", dict)):
        return _recipes().evaluate(req, device=resolve_device(_field(req, "device", str, "auto")))
    config = ModelConfig.from_dict(_field(req, "model", dict))
    weights = load_named(_field(req, "weights_path", str))
    data = read_ranges(_field(req, "data_path", str), [req.get("data_range")])
    loss = evaluate(
        config, weights, data, _field(req, "num_batches", int), _field(req, "seed", int), _field(req, "batch_size", int, 8),
        device=resolve_device(_field(req, "device", str, "auto")),
    )
    return {"loss": loss}


def handle_ping(req: dict) -> dict:
    import torch

    return {"pid": os.getpid(), "torch": torch.__version__}


def _recipes():
    """The registry of the recipes beyond tiny-lm (node/train/recipes.py), imported on first use."""
    from node.train import recipes
    return recipes


def handle_prepare(req: dict) -> dict:
    return _recipes().prepare(req)


def handle_gain(req: dict) -> dict:
    from node.train.inner import resolve_device

    started = time.monotonic()
    if not _recipes().is_hf(_field(req, "model", dict)):
        from node.train import check
        reply = check.handle(req)
    else:
        reply = _recipes().gain(req, device=resolve_device(_field(req, "device", str, "auto")))
    return {**reply, "seconds": time.monotonic() - started}


HANDLERS = {"ping": handle_ping, "train": handle_train, "eval": handle_eval, "prepare": handle_prepare,
            "gain": handle_gain}


def serve(stdin: BinaryIO, stdout: BinaryIO) -> int:
    while True:
        rid = None
        try:
            _step_ahead(stdin)
            payload = read_frame(stdin)
            if payload is None:
                return 0
            req = decode_frame(payload)
            rid = req.get("id")
            op = req.get("op")
            if op not in HANDLERS:
                raise ValueError(f"unknown op {op!r}; known: {sorted(HANDLERS)}")
            start = time.monotonic()
            reply = {"id": rid, "ok": True, **HANDLERS[op](req)}
            _log(f"{op} id={rid} done in {time.monotonic() - start:.2f}s")
        except EOFError as exc:
            _log(f"exiting: {exc}")
            return 1
        except Exception as exc:  # the one supervision point: a bad request must not end the worker
            _log(f"request id={rid} failed:\n{traceback.format_exc()}")
            reply = {"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            frame = encode_frame(reply)
        except ValueError as exc:
            frame = encode_frame({"id": rid, "ok": False, "error": f"ValueError: {exc}"})
        stdout.write(frame)
        stdout.flush()


def main() -> int:
    if os.environ.get("TRAINER_LOG_JSON"):  # the node logs JSON lines: so does everything written here
        from node.logs import relay_stderr_as_json
        relay_stderr_as_json("shoal.trainer")
    # Keep stdout for frames only: anything a library prints goes to stderr instead.
    frames_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    threads = os.environ.get("TRAINER_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    return serve(sys.stdin.buffer, frames_out)


if __name__ == "__main__":
    sys.exit(main())
