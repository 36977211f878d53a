"""What a task keeps on disk between rounds: the checkpoint (weights and outer momentum), the inner optimizer's
state and the error-feedback residual, one file per round where a round redone after a restart must start from
what its first attempt started from. Each is written so that a crash leaves the old or the new; the long writes
run in a thread (one in flight per kind and task directory) whose error the next wait re-raises."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from node.fsutil import fsync_dir, round_files, write_atomic
from node.tasks.compute import OuterState, momentum_named
from node.train.diloco import Named, OuterNesterov, load_named, save_named
from protocol.task import TaskSpec

log = logging.getLogger("shoal.tasks")

_pending: dict[tuple[Path, str], tuple[threading.Thread, list[BaseException]]] = {}
_pending_lock = threading.Lock()


def _in_background(directory: Path, kind: str, name: str, work: Callable[[], None]) -> None:
    """Run ``work`` in a thread, as ``directory``'s write of ``kind`` in flight (the caller waited for the last)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # re-raised by the next wait, in the caller's thread
            errors.append(exc)
    thread = threading.Thread(target=run, name=name)
    with _pending_lock:
        _pending[(Path(directory), kind)] = (thread, errors)
    thread.start()


def _wait(directory: Path, kind: str) -> None:
    """Block until ``directory``'s write of ``kind`` in flight (if any) is done; raise its error."""
    with _pending_lock:
        pending = _pending.pop((Path(directory), kind), None)
    if pending is not None:
        pending[0].join()
        if pending[1]:
            raise pending[1][0]


RESIDUAL_PREFIX = "residual-r"
INNER_OPT_PREFIX = "inner-opt-r"
"""The inner AdamW state after training round r: round r+1 trains from it, and a round retrained after a
restart from the newest one before it, as the first attempt did (one file per task would be a round ahead)."""
LEGACY_INNER_OPT = "inner_opt.safetensors"


def round_file(directory: Path, prefix: str, round_: int) -> Path:
    return directory / f"{prefix}{round_}.safetensors"


def newest_before(directory: Path, prefix: str, round_: int) -> Path | None:
    """The newest ``prefix<r>.safetensors`` with r < ``round_``; the older ones are deleted."""
    found = [(r, path) for r, path in round_files(directory, prefix, ".safetensors") if r < round_]
    if not found:
        return None
    found.sort()
    for _, path in found[:-1]:
        path.unlink(missing_ok=True)
    return found[-1][1]


def inner_opt_paths(directory: Path, round_: int) -> tuple[Path | None, Path]:
    """(the inner optimizer state to train round ``round_`` from, where its state after the round goes)."""
    legacy = directory / LEGACY_INNER_OPT
    read = newest_before(directory, INNER_OPT_PREFIX, round_)
    if read is None and legacy.exists():
        read = legacy  # written by a node before these files had rounds: it holds the newest state
    elif read is not None:
        legacy.unlink(missing_ok=True)
    return read, round_file(directory, INNER_OPT_PREFIX, round_)


def load_residual(directory: Path, round_: int) -> Named | None:
    """The error-feedback residual left by the newest update before ``round_`` (work redone for a round starts
    from the same residual as the first attempt); older ones are deleted."""
    _settle_residual(directory)
    path = newest_before(directory, RESIDUAL_PREFIX, round_)
    if path is None:
        return None
    try:
        return load_named(path)
    except (OSError, SafetensorError):
        return None  # a torn file: the feedback restarts from nothing, which costs only precision


def save_residual(directory: Path, round_: int, residual: Named, background: bool = False) -> None:
    """Round ``round_``'s residual to disk (no fsync: a torn file reads as none); ``background``: in a thread,
    after the one in flight for ``directory``, if any. The tensors must not change while it is written."""
    directory = Path(directory)
    _settle_residual(directory)
    path = round_file(directory, RESIDUAL_PREFIX, round_)

    def write() -> None:
        save_named(path, residual, durable=False)
        # The one before stays: redoing this round after a restart starts from it.
        for r, old in round_files(directory, RESIDUAL_PREFIX, ".safetensors"):
            if r < round_ - 1:
                old.unlink(missing_ok=True)
    if background:
        _in_background(directory, "residual", f"residual-r{round_}", write)
    else:
        write()


def wait_residual(directory: Path) -> None:
    """Block until ``directory``'s residual in flight (if any) is written; raise its error."""
    _wait(directory, "residual")


def _settle_residual(directory: Path) -> None:
    """wait_residual, its OSError logged: a residual not written (a full disk) costs a restart's first update its
    feedback, and is no reason to fail this round's."""
    try:
        wait_residual(directory)
    except OSError as exc:
        log.warning("an error-feedback residual was not saved: %s", exc)


# -- checkpoints ---------------------------------------------------------------------------------
#
# <dir>/checkpoints/r<round>-<hash>/{weights,momentum}.safetensors hold one round each; <dir>/meta.json (written last,
# atomically) names the complete one. <dir>/weights.safetensors is a hard link to the newest weights, the file
# the trainer reads. save_weights writes and links the weights (no fsync: the trainer only needs them in the page
# cache) and leaves the rest, fsyncs, momentum, meta.json and removing older rounds, to a thread: a crash at any
# point leaves meta.json naming a complete, fsynced round.

CHECKPOINTS = "checkpoints"


def _round_dir(directory: Path, state: OuterState) -> Path:
    # The hash in the name: a re-sync to another history at the same round never rewrites the complete one.
    return directory / CHECKPOINTS / f"r{state.round:08d}-{state.weights_hash()[:16]}"


def save_weights(directory: Path, state: OuterState) -> None:
    """θ's file for the trainer now; the rest of the checkpoint in a thread (see above). Waits for the previous
    checkpoint of ``directory`` first, so at most one is in flight, and raises the error it ended with, if any."""
    directory = Path(directory)
    wait_checkpoint(directory)
    round_dir = _round_dir(directory, state)
    round_dir.mkdir(parents=True, exist_ok=True)
    save_named(round_dir / "weights.safetensors", state.weights, durable=False)
    _link(round_dir / "weights.safetensors", directory / "weights.safetensors")
    _in_background(directory, "checkpoint", f"checkpoint-r{state.round}",
                   lambda: _finish(directory, round_dir, state))


def wait_checkpoint(directory: Path) -> None:
    """Block until ``directory``'s checkpoint in flight (if any) is complete; raise its error."""
    _wait(directory, "checkpoint")


def _finish(directory: Path, round_dir: Path, state: OuterState) -> None:
    with open(round_dir / "weights.safetensors", "rb+") as f:
        os.fsync(f.fileno())
    save_named(round_dir / "momentum.safetensors", momentum_named(state.outer))  # fsyncs round_dir as well
    fsync_dir(round_dir.parent)
    meta = {"round": state.round, "weights_hash": state.weights_hash(), "state_hash": state.state_hash(),
            "work": state.work, "dir": f"{CHECKPOINTS}/{round_dir.name}"}
    write_atomic(directory / "meta.json", json.dumps(meta).encode())
    # No other round is in flight (save_weights waits for this one), so every other round is superseded.
    for old in (directory / CHECKPOINTS).iterdir():
        if old != round_dir:
            shutil.rmtree(old, ignore_errors=True)


def _link(target: Path, name: Path) -> None:
    tmp = name.with_name(f".{name.name}.{os.getpid()}.{threading.get_ident()}.link")
    tmp.unlink(missing_ok=True)
    os.link(target, tmp)
    os.replace(tmp, name)


def save_checkpoint(directory: Path, state: OuterState) -> dict:
    """A whole checkpoint, waited for: save_weights and its thread."""
    save_weights(directory, state)
    wait_checkpoint(directory)
    return json.loads((Path(directory) / "meta.json").read_text())


def load_checkpoint(directory: Path, spec: TaskSpec) -> OuterState | None:
    """The checkpoint meta.json names, or None if there is none or it does not verify; the trainer's weights
    file is pointed back at it (a crash may have left it at a newer, incomplete round)."""
    directory = Path(directory)
    wait_checkpoint(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text())
        where = directory / meta.get("dir", ".")  # "." : the one-directory layout of earlier versions
        weights = load_named(where / "weights.safetensors")
        momentum = load_named(where / "momentum.safetensors")
    except (OSError, ValueError, SafetensorError):  # a torn or rotted file is no checkpoint, not a crash
        return None
    outer = OuterNesterov(lr=spec.outer_lr, momentum=spec.outer_momentum)
    outer.load_state_dict(momentum)
    state = OuterState(round=int(meta["round"]), weights=weights, outer=outer, work=int(meta.get("work", 0)))
    if state.weights_hash() != meta.get("weights_hash") or state.state_hash() != meta.get("state_hash"):
        return None
    if where != directory:
        _link(where / "weights.safetensors", directory / "weights.safetensors")
    return state
