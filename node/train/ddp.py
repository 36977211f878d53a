"""The inner loop on several local devices: one process per device under torch.distributed (DDP), started by the
trainer child. Every rank draws the same global batch and trains on its slice of the rows; DDP averages the
gradients, so the update is one process's update on the whole batch (up to float summation order).
Between nodes nothing changes: rank 0's weights become this node's pseudo-gradient as before.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from node.train.data import batches
from node.train.diloco import Named, load_named, named_tensors, save_named
from node.train.inner import AdamWConfig, lm_loss, model_from_weights
from node.train.model import ModelConfig


def _worker(rank: int, world_size: int, init_file: str, job: dict, out_path: str) -> None:
    cuda = job["backend"] == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(job["backend"], init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        config = ModelConfig.from_dict(job["model"])
        model = model_from_weights(config, load_named(job["base_path"]), device)
        model.train()
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
        names = sorted(n for n, _ in model.named_parameters())
        by_name = dict(model.named_parameters())
        params = [by_name[n] for n in names]
        adamw = AdamWConfig.from_dict(job["adamw"])
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": adamw.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=adamw.lr, betas=(adamw.beta1, adamw.beta2), eps=adamw.eps, foreach=False)
        sampler = batches(Path(job["data_path"]).read_bytes(), config.seq_len, job["batch_size"], job["seed"])
        for _ in range(job["steps"]):
            batch = next(sampler)[rank::world_size].to(device)
            loss = lm_loss(wrapped, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            if adamw.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, adamw.grad_clip)
            opt.step()
        if rank == 0:
            save_named(out_path, named_tensors(model))
    finally:
        dist.destroy_process_group()


def train_inner_ddp(*, world_size: int, model_config: ModelConfig, base_weights: Named, data: bytes, steps: int,
                    batch_size: int, seed: int, adamw: AdamWConfig = AdamWConfig(), backend: str | None = None) -> Named:
    """``steps`` AdamW steps from base_weights over world_size local processes; the trained weights.

    backend: "nccl" (one CUDA device per rank) when there are enough GPUs, else "gloo" on the CPU.
    """
    if world_size < 1 or batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} must split evenly over {world_size} processes")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    import dataclasses
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="shoal-ddp-") as tmp:
        base_path, data_path, out_path = (os.path.join(tmp, n) for n in ("base.safetensors", "data", "out.safetensors"))
        save_named(base_path, base_weights)
        Path(data_path).write_bytes(data)
        job = {"backend": backend, "model": model_config.to_dict(), "base_path": base_path, "data_path": data_path,
               "steps": steps, "batch_size": batch_size, "seed": seed, "adamw": dataclasses.asdict(adamw)}
        mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "rendezvous"), job, out_path),
                           nprocs=world_size, join=True, start_method="spawn")
        return load_named(out_path)
