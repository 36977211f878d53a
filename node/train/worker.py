"""The trainer child process: length-prefixed msgpack requests on stdin, replies on stdout.

Frame: 4-byte big-endian length, then a msgpack map, at most MAX_FRAME_BYTES. Tensors never
cross the pipe, only file paths. Requests (every one carries an "id", echoed in the reply):

    {"op": "ping"} -> {"ok": true, "pid", "torch"}
    {"op": "train", "model": {n_layer, n_head, d_model, seq_len, dropout?}, "base_path",
     "data_path", "shard_ranges": [[start, end], ...], "steps", "batch_size", "seed",
     "out_path", "time_budget_s"?: float|None, "adamw"?: {lr, beta1, beta2, eps, weight_decay,
     warmup_steps, grad_clip}, "opt_state_path"?: str|None, "log_every"?: int}
      -> {"ok": true, "samples", "steps", "losses": [[step, loss], ...], "seconds",
          "out_path", "base_hash", "update_hash"}
    {"op": "eval", "model", "weights_path", "data_path", "data_range": [start, end],
     "num_batches", "batch_size", "seed"} -> {"ok": true, "loss"}

train writes the pseudo-gradient Δ = base − trained (float32, named, safetensors) to out_path,
since Δ is what the round compresses and ships; base_hash and update_hash are weights_hash of
the base it loaded and of Δ. If opt_state_path is given, the AdamW state is read from it when
the file exists and written back after training, so a peer's inner optimizer carries across
rounds. Shard ranges are byte ranges of data_path, concatenated in the order given.

A request that fails gets {"ok": false, "error": "<Type>: <message>"} and the worker keeps
serving. EOF on stdin at a frame boundary exits 0. Progress lines go to stderr.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from typing import BinaryIO

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


def _ranges(value, size: int) -> list[tuple[int, int]]:
    if not isinstance(value, list) or not value:
        raise ValueError("shard_ranges must be a non-empty list of [start, end]")
    out = []
    for r in value:
        if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and 0 <= r[0] < r[1] <= size):
            raise ValueError(f"byte range {r!r} is not [start, end) inside the {size} byte data file")
        out.append((r[0], r[1]))
    return out


def _read_ranges(path: str, ranges_value) -> bytes:
    size = os.path.getsize(path)
    out = bytearray()
    with open(path, "rb") as f:
        for start, end in _ranges(ranges_value, size):
            f.seek(start)
            out += f.read(end - start)
    return bytes(out)


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
        _log(f"train id={req.get('id')}: {world} processes ({'NCCL on CUDA' if device.type == 'cuda' else 'gloo'})")
        return run_ranks(world, functools.partial(_train_rank, req), cuda=device.type == "cuda")
    if asked > 1:
        _log(f"train id={req.get('id')}: one process (asked for {asked}; the devices or the batch do not split)")
    return _train(req, device, None)


def _train_rank(req: dict, ranks) -> dict:
    return _train(req, ranks.device, ranks)


def _train(req: dict, device, ranks) -> dict:
    from node.train.diloco import load_named, pseudo_gradient, save_named, weights_hash
    from node.train.inner import AdamWConfig, train_inner
    from node.train.model import ModelConfig
    from node.train.ranks import device_label

    rid = req.get("id")
    lead = ranks is None or ranks.rank == 0

    def progress(step: int, loss: float) -> None:
        if lead:
            _log(f"train id={rid} step {step}/{req.get('steps')} loss {loss:.4f}")

    if _recipes().is_hf(_field(req, "model", dict)):
        return _recipes().train(req, device=device, progress=progress, ranks=ranks)
    config = ModelConfig.from_dict(_field(req, "model", dict))
    adamw = AdamWConfig.from_dict(_field(req, "adamw", dict, {}))
    base = load_named(_field(req, "base_path", str))
    data = _read_ranges(_field(req, "data_path", str), req.get("shard_ranges"))
    steps = _field(req, "steps", int)
    budget = _field(req, "time_budget_s", (int, float), None)
    opt_path = _field(req, "opt_state_path", str, None)
    out_path = _field(req, "out_path", str)
    opt_state = load_named(opt_path) if opt_path and os.path.exists(opt_path) else None

    result = train_inner(
        model_config=config,
        base_weights=base,
        data=data,
        steps=steps,
        batch_size=_field(req, "batch_size", int),
        seed=_field(req, "seed", int),
        adamw=adamw,
        time_budget_s=budget,
        opt_state=opt_state,
        log_every=_field(req, "log_every", int, 10),
        progress=progress,
        device=device,
        ranks=ranks,
    )
    if not lead:
        return {}
    delta = pseudo_gradient(base, result.weights)
    save_named(out_path, delta)
    if opt_path:
        save_named(opt_path, result.opt_state)
    return {
        "samples": result.samples,
        "steps": result.steps,
        "losses": [[s, loss] for s, loss in result.losses],
        "seconds": result.seconds,
        "out_path": out_path,
        "base_hash": weights_hash(base),
        "update_hash": weights_hash(delta),
        "device": device_label(device, ranks),
    }


def handle_eval(req: dict) -> dict:
    from node.train.diloco import load_named
    from node.train.inner import evaluate, resolve_device
    from node.train.model import ModelConfig

    if _recipes().is_hf(_field(req, "model", dict)):
        return _recipes().evaluate(req, device=resolve_device(_field(req, "device", str, "auto")))
    config = ModelConfig.from_dict(_field(req, "model", dict))
    weights = load_named(_field(req, "weights_path", str))
    data = _read_ranges(_field(req, "data_path", str), [req.get("data_range")])
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


HANDLERS = {"ping": handle_ping, "train": handle_train, "eval": handle_eval, "prepare": handle_prepare}


def serve(stdin: BinaryIO, stdout: BinaryIO) -> int:
    while True:
        rid = None
        try:
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
