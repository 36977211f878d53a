"""The daemon's side of the hf-* recipes: fetch and check the model bundle and dataset, judge them, hand them to the
trainer, and ask it to measure others' updates for the training checks (``gain``).

Every refusal here is a TaskRejected with the reason (the task shows "declined"): a model directory
with pickle or remote code, a dataset whose bytes do not hash to the spec's sha256, a tokenizer that
does not fit the model, a model too big for this node, a trainer whose torch the task does not allow.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
import trio

from node import bundle
from node.dataset import decode_records, split_records
from node.tasks.checks import ask_trainer
from node.tasks.training_check import CHECK_BATCHES
from node.train.client import TrainerCrashed, TrainerRequestFailed
from node.train.data import derive_seed
from node.train.diloco import Named, load_named
from protocol.errors import ConfigError, RemoteProtocolError, TaskRejected, TransportError
from protocol.manifest import KIND_FILE
from protocol.task import TaskSpec, task_id

log = logging.getLogger("shoal.tasks")

_INITIAL: dict[str, Named] = {}
"""θ_0 of each prepared hf task (by task id): the trainable tensors the trainer drew, the layout every
fetched or aggregated state is checked against (node/tasks/compute.py initial_weights)."""


def initial_weights(spec: TaskSpec) -> Named:
    tid = task_id(spec)
    if tid not in _INITIAL:
        raise TaskRejected(f"task {tid[:12]}: the model is not prepared on this node yet")
    return {n: t.clone() for n, t in _INITIAL[tid].items()}


def check_trainer(spec: TaskSpec, ping: dict) -> None:
    """TaskRejected unless the trainer's torch is the one the task pins (if it pins one)."""
    pin = spec.requirements.torch_version
    if pin and ping.get("torch") != pin:
        raise TaskRejected(f"the task pins torch {pin} and this node's trainer runs torch {ping.get('torch')}: "
                           "the outer step must be bit-identical on every member")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class HFTask:
    """Inputs and trainer requests of one hf-* task on this node."""

    def __init__(self, runner):
        self.runner = runner
        self.spec: TaskSpec = runner.spec
        self.hf = runner.spec.hf
        data_dir = runner.node.config.data_dir
        self.model_dir = data_dir / "models" / self.hf.model_manifest
        self.data_path = data_dir / "datasets" / f"{self.spec.dataset.sha256}.jsonl"
        self.num_records = 0
        self._num_params = 0
        self.info: dict = {}

    # -- inputs ----------------------------------------------------------------------------------

    async def _fetch_file(self, manifest_hex: str, dest: Path, what: str, max_bytes: int) -> None:
        shardcast = self.runner.node.shardcast
        timeout_s = max(self.runner.options.dataset_wait_s, self.spec.round_deadline_s)
        try:
            with trio.fail_after(timeout_s):
                manifest = await shardcast.fetch(bytes.fromhex(manifest_hex))
        except (RemoteProtocolError, TransportError, trio.TooSlowError) as exc:
            raise TaskRejected(f"the {what} {manifest_hex[:16]} could not be fetched: {exc or 'timed out'}") from None
        if manifest.kind != KIND_FILE or manifest.total_bytes > max_bytes:
            raise TaskRejected(f"the {what} {manifest_hex[:16]} is not a file of at most {max_bytes} bytes")
        dest.parent.mkdir(parents=True, exist_ok=True)
        await trio.to_thread.run_sync(shardcast.export_file, manifest, dest)

    async def _model(self) -> None:
        if (self.model_dir / "config.json").is_file():
            return
        bundle_path = self.runner.dir / "model.bundle"
        self.runner.detail = f"fetching the model {self.hf.model_manifest[:16]}"
        await self._fetch_file(self.hf.model_manifest, bundle_path, "model bundle", 1 << 40)
        try:
            await trio.to_thread.run_sync(bundle.unpack, bundle_path, self.model_dir)
        except ConfigError as exc:
            raise TaskRejected(f"model {self.hf.model_manifest[:16]} refused: {exc}") from None
        finally:
            bundle_path.unlink(missing_ok=True)

    async def _dataset(self) -> None:
        ds = self.spec.dataset
        if self.data_path.is_file() and await trio.to_thread.run_sync(_sha256_file, self.data_path) == ds.sha256:
            return
        part = self.data_path.with_name(self.data_path.name + ".part")
        self.runner.detail = f"fetching the dataset {ds.manifest[:16]}"
        await self._fetch_file(ds.manifest, part, "dataset", ds.max_bytes)
        got = await trio.to_thread.run_sync(_sha256_file, part)
        if got != ds.sha256:
            part.unlink(missing_ok=True)
            raise TaskRejected(f"dataset hash mismatch: the spec names sha256 {ds.sha256[:16]}..., the bytes of "
                               f"manifest {ds.manifest[:16]} hash to {got[:16]}...; republish the spec with the "
                               "values `shoal dataset publish` printed")
        part.rename(self.data_path)

    async def fetch_inputs(self) -> Path:
        """The model directory and the records file, fetched over SHARDCAST and checked; the records path."""
        before = self.runner.node.shardcast.statistics().bytes_fetched
        await self._model()
        await self._dataset()
        # The one-time fetch of the inputs, kept apart so per-round traffic can be told from it.
        self.info["input_bytes_fetched"] = self.runner.node.shardcast.statistics().bytes_fetched - before
        try:
            recs = await trio.to_thread.run_sync(decode_records, self.data_path.read_bytes())
            self.num_records = len(recs)
            split_records(self.num_records, self.spec.dataset.num_shards, self.spec.dataset.heldout_fraction)
        except (ValueError, ConfigError) as exc:
            raise TaskRejected(f"dataset {self.spec.dataset.sha256[:16]} unusable: {exc}") from None
        return self.data_path

    # -- the trainer -----------------------------------------------------------------------------

    def model_request(self) -> dict:
        h = self.hf
        return {"recipe": self.spec.recipe, "model_dir": str(self.model_dir), "method": h.method,
                "seq_len": h.seq_len, "lora_r": h.lora_r, "lora_alpha": h.lora_alpha,
                "target_modules": list(h.target_modules), "dpo_beta": h.dpo_beta}

    async def setup(self, trainer) -> None:
        """The trainer loads the model once: checks it against the tokenizer and data, draws θ_0, sizes it."""
        self.runner.detail = "loading the model"
        out = self.runner.dir / "initial.safetensors"
        try:
            reply = await trainer.request("prepare", model=self.model_request(), data_path=str(self.data_path),
                                          seed=self.spec.seed, out_path=str(out))
        except TrainerRequestFailed as exc:
            raise TaskRejected(str(exc).removeprefix("trainer prepare failed: ").removeprefix("ValueError: ")) from None
        memory = self.runner.node.membership.hardware.memory_bytes
        need = max(int(reply["memory_estimate_bytes"]), self.spec.requirements.min_memory_bytes)
        if memory and need > memory:
            raise TaskRejected(f"the model ({reply['total_params']:,} parameters) needs about {need / 2**30:.1f} GiB "
                               f"to train and this node has {memory / 2**30:.1f} GiB")
        self._num_params = int(reply["num_params"])
        self.info.update({k: reply[k] for k in ("num_params", "total_params", "num_records", "memory_estimate_bytes")})
        _INITIAL[self.runner.tid] = await trio.to_thread.run_sync(load_named, out)
        log.info("task %s: %s %s, %d of %d parameters trained and exchanged", self.runner.tid[:12], self.spec.recipe,
                 self.hf.method, self._num_params, reply["total_params"])

    def num_params(self) -> int:
        return self._num_params

    def _split(self):
        ds = self.spec.dataset
        return split_records(self.num_records, ds.num_shards, ds.heldout_fraction)

    def train_ranges(self, shard_ids: list[int]) -> list[tuple[int, int]]:
        shards, _ = self._split()
        return [shards[i] for i in shard_ids]

    def heldout_range(self) -> tuple[int, int]:
        return self._split()[1]

    async def gain(self, round_: int, producer: str, base: Named, delta: torch.Tensor,
                   shards: list[int]) -> tuple[float, float] | None:
        """``producer``'s update's gain on the first batches it drew (TrainingChecks ``measure``), measured by this
        node's trainer child, which holds the model: θ_r and Δ̂ go to it as files, removed after. None when it
        cannot be measured here (no trainer, or the trainer failed it): nobody is judged on a guess."""
        runner = self.runner
        if runner.trainer is None:
            return None
        try:
            reply = await ask_trainer(
                runner.trainer, runner.dir, round_, producer, base, {"delta": lambda: delta},
                model=self.model_request(), data_path=str(self.data_path),
                shard_ranges=[list(r) for r in self.train_ranges(shards)],
                seed=derive_seed(runner.tid, round_, producer), batch_size=self.spec.batch_size, count=CHECK_BATCHES,
                device=runner._device())
            return float(reply["gain"]), reply["seconds"]
        except (TrainerCrashed, TrainerRequestFailed, OSError, ValueError, IndexError) as exc:
            log.warning("task %s round %d: %s's update not checked: %s", runner.tid[:12], round_, producer, exc)
            return None
