"""Several local devices in one node's inner loop: one process per device under torch.distributed.

The trainer child starts the ranks for a train request that asks for more than one process. Every
rank draws the same global batch from the same seed, computes the loss on its share of the rows,
and the gradients are averaged over the ranks before clipping and the AdamW step, as DDP does; so
the update is one process's update on the whole batch, up to float summation order. The ranks
agree on stopping early (the time budget is rank 0's clock), and the losses a node commits to are
the whole batch's. Rank 0 writes the result. Between nodes nothing changes.

Averaging the gradients by hand instead of wrapping the model in DistributedDataParallel keeps one
code path for every recipe: the tiny LM, full fine-tuning and a peft LoRA model alike.

With ``shard`` (for a model whose weights, gradients and AdamW moments do not fit one device), the
model is built on the CPU and wrapped in FSDP2 (``fully_shard``): each block of every ModuleList is
one unit, the rest the root's. Every rank then holds 1/world of each parameter and of its optimizer
state on its device, gathers a unit's weights only while it computes it, and the gradients are
reduce-scattered (averaged) by FSDP instead of average_grads. Weights and optimizer state leave the
ranks whole (``full``), so a sharded round's update and state are those of a replicated one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    device: torch.device
    shard: bool = False
    mesh: Any = None
    """The ranks' device mesh (sharded only)."""

    def build_device(self) -> torch.device:
        """Where a model is built: the CPU when sharded (fully_shard moves each rank's share to its device)."""
        return torch.device("cpu") if self.shard else self.device

    def prepare(self, model: torch.nn.Module) -> None:
        """Shard ``model`` across the ranks (with ``shard``); its parameters become DTensors, so callers take
        them from the model afterwards."""
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard
        for module in list(model.modules()):
            if isinstance(module, torch.nn.ModuleList):
                for block in module:
                    if any(True for _ in block.parameters()):
                        fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)

    @staticmethod
    def full(t: torch.Tensor) -> torch.Tensor:
        """A sharded tensor gathered whole (a collective: every rank calls it); any other as it is."""
        return t.full_tensor() if _is_dtensor(t) else t

    @staticmethod
    def like(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """``whole`` laid out as ``param`` is: this rank's shard of it for a sharded parameter."""
        if _is_dtensor(param):
            from torch.distributed.tensor import distribute_tensor
            return distribute_tensor(whole.to(param.device_mesh.device_type), param.device_mesh, param.placements)
        return whole.to(param.device)

    def share(self, batch):
        """This rank's share of a global batch (a tensor's rows or a list): items rank, rank + world, ..."""
        return batch[self.rank::self.world]

    def average_grads(self, params: list[torch.Tensor]) -> None:
        if self.shard:
            return  # FSDP reduce-scattered them, averaged, in backward
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


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def device_label(device: torch.device, ranks: Ranks | None) -> str:
    """Where a train request ran, for its reply: "cuda:0", "cuda x2" over two ranks, "cuda x2 sharded"."""
    if ranks is None:
        return str(device)
    return f"{device.type} x{ranks.world}" + (" sharded" if ranks.shard else "")


def usable_processes(asked: int, batch_size: int, cuda: bool) -> int:
    """How many ranks a request can use: at most one per CUDA device (on CUDA), dividing the batch evenly."""
    n = max(1, asked)
    if cuda:
        n = max(1, min(n, torch.cuda.device_count()))
    while n > 1 and batch_size % n:
        n -= 1
    return n


def _rank_main(rank: int, world: int, backend: str, init_file: str, job: Callable[[Ranks], dict],
               result_path: str, shard: bool) -> None:
    os.dup2(2, 1)  # the trainer's stdout carries its frames to the daemon: a rank must never write there
    sys.stdout = sys.stderr
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = None
        if shard:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(device.type, (world,))
        result = job(Ranks(rank=rank, world=world, device=device, shard=shard, mesh=mesh))
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
        dist.barrier()  # no rank tears the group down while another may still use it
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, job: Callable[[Ranks], dict], *, cuda: bool, shard: bool = False) -> dict:
    """job(ranks) in `world` fresh processes (NCCL on CUDA devices, else gloo on the CPU); rank 0's result.
    With ``shard``, the ranks shard the model (FSDP2) instead of each holding all of it.

    job must be picklable (a module-level function or a functools.partial of one). An exception in any
    rank ends them all and is raised here with that rank's traceback.
    """
    import torch.multiprocessing as mp
    backend = "nccl" if cuda else "gloo"
    with tempfile.TemporaryDirectory(prefix="shoal-ranks-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.start_processes(_rank_main, args=(world, backend, os.path.join(tmp, "rendezvous"), job, result_path, shard),
                           nprocs=world, join=True, start_method="spawn")
        with open(result_path) as f:
            return json.load(f)
