"""Several local devices in one node's inner loop: one process per device under torch.distributed.

The trainer child starts the ranks for a train request that asks for more than one process. Every
rank draws the same global batch from the same seed, computes the loss on its share of the rows,
and the gradients are averaged over the ranks before clipping and the AdamW step, as DDP does; so
the update is one process's update on the whole batch, up to float summation order. The ranks
agree on stopping early (the time budget is rank 0's clock), and the losses a node commits to are
the whole batch's. Rank 0 writes the result. Between nodes nothing changes.

Averaging the gradients by hand instead of wrapping the model in DistributedDataParallel keeps one
code path for every recipe: the tiny LM, full fine-tuning and a peft LoRA model alike.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    device: torch.device

    def share(self, batch):
        """This rank's share of a global batch (a tensor's rows or a list): items rank, rank + world, ..."""
        return batch[self.rank::self.world]

    def average_grads(self, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def agree(self, flag: bool) -> bool:
        """Rank 0's flag, on every rank."""
        t = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item())

    def mean(self, value: torch.Tensor) -> float:
        t = value.detach().reshape(1).to(self.device, torch.float32)
        dist.all_reduce(t)
        return float(t.item()) / self.world


def device_label(device: torch.device, ranks: Ranks | None) -> str:
    """Where a train request ran, for its reply: "cuda:0", or "cuda x2" over two ranks."""
    return str(device) if ranks is None else f"{device.type} x{ranks.world}"


def usable_processes(asked: int, batch_size: int, cuda: bool) -> int:
    """How many ranks a request can use: at most one per CUDA device (on CUDA), dividing the batch evenly."""
    n = max(1, asked)
    if cuda:
        n = max(1, min(n, torch.cuda.device_count()))
    while n > 1 and batch_size % n:
        n -= 1
    return n


def _rank_main(rank: int, world: int, backend: str, init_file: str, job: Callable[[Ranks], dict],
               result_path: str) -> None:
    os.dup2(2, 1)  # the trainer's stdout carries its frames to the daemon: a rank must never write there
    sys.stdout = sys.stderr
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = job(Ranks(rank=rank, world=world, device=device))
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, job: Callable[[Ranks], dict], *, cuda: bool) -> dict:
    """job(ranks) in `world` fresh processes (NCCL on CUDA devices, else gloo on the CPU); rank 0's result.

    job must be picklable (a module-level function or a functools.partial of one). An exception in any
    rank ends them all and is raised here with that rank's traceback.
    """
    import torch.multiprocessing as mp
    backend = "nccl" if cuda else "gloo"
    with tempfile.TemporaryDirectory(prefix="shoal-ranks-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.start_processes(_rank_main, args=(world, backend, os.path.join(tmp, "rendezvous"), job, result_path),
                           nprocs=world, join=True, start_method="spawn")
        with open(result_path) as f:
            return json.load(f)
