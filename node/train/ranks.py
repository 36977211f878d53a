"""Several local devices in one node's inner loop: one process per device under torch.distributed.

The trainer child starts the ranks for a train request that asks for more than one process. Every
rank draws the same global batch from the same seed, computes the loss on its share of the rows,
and the gradients are averaged over the ranks before clipping and the AdamW step, as DDP does; so
the update is one process's update on the whole batch, up to float summation order. The ranks
agree on stopping early (the time budget is rank 0's clock), and the losses a node commits to are
the whole batch's. Rank 0's result is the request's. Between nodes nothing changes. The rank processes
are kept for the next request (RankPool), so the process group is set up once, not every round.

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

import atexit
import os
import queue
import sys
import tempfile
import traceback
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


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the trainer child that started it dies (a rank blocked in a
    collective would otherwise outlive it)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the loop below still notices its parent is gone between jobs


def _rank_loop(rank: int, world: int, backend: str, init_file: str, shard: bool, inbox, outbox, parent: int) -> None:
    """One rank of a RankPool: join the process group once, then run each job sent until told to stop."""
    _die_with_parent()
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
        ranks = Ranks(rank=rank, world=world, device=device, shard=shard, mesh=mesh)
        while (job := _next_job(inbox, parent)) is not None:
            try:
                result = job(ranks)
                dist.barrier()  # every rank done with the job's collectives before the next job
            except BaseException:
                outbox.put((rank, False, traceback.format_exc()))
                # The group may be left mid-collective: the pool is closed and started afresh. Until then this
                # rank keeps its connections, so the others wait rather than fail on a closed peer and bury
                # the cause under their own errors.
                while _next_job(inbox, parent) is not None:
                    pass
                return
            outbox.put((rank, True, result if rank == 0 else None))
            del result
            if cuda:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def _next_job(inbox, parent: int):
    """The next job sent to this rank; None when told to stop or when the trainer child is gone."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


class RankPool:
    """``world`` rank processes kept between train requests (NCCL on CUDA devices, else gloo on the CPU).

    Starting a rank costs seconds (a torch import, a CUDA context, the process group's rendezvous): paid
    once per pool, not once per round. A job that fails in any rank, or a rank that dies, closes the pool;
    the next request starts a new one."""

    def __init__(self, world: int, *, cuda: bool, shard: bool):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.key = (world, cuda, shard)
        self._tmp = tempfile.TemporaryDirectory(prefix="shoal-ranks-")
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._outbox = ctx.Queue()
        backend = "nccl" if cuda else "gloo"
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._procs = [ctx.Process(target=_rank_loop, args=(r, world, backend, init_file, shard, self._inboxes[r],
                                                              self._outbox, os.getpid()), daemon=True)
                       for r in range(world)]
        for p in self._procs:
            p.start()

    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, job: Callable[[Ranks], dict]) -> dict:
        """job(ranks) on every rank; rank 0's result. RuntimeError (the pool closed) if a rank fails or dies."""
        for inbox in self._inboxes:
            inbox.put(job)
        results: dict[int, dict | None] = {}
        while len(results) < len(self._procs):
            try:
                rank, ok, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    self.close()
                    raise RuntimeError(f"rank process {dead[0].pid} exited (code {dead[0].exitcode})") from None
                continue
            if not ok:
                self.close()
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
        return results[0]

    def close(self) -> None:
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self._procs = []
        self._tmp.cleanup()


_pool: RankPool | None = None


def run_ranks(world: int, job: Callable[[Ranks], dict], *, cuda: bool, shard: bool = False) -> dict:
    """job(ranks) in `world` rank processes (NCCL on CUDA devices, else gloo on the CPU); rank 0's result.
    With ``shard``, the ranks shard the model (FSDP2) instead of each holding all of it. The processes are
    kept for the next call with the same world, device and sharding (RankPool).

    job must be picklable (a module-level function or a functools.partial of one). An exception in any
    rank ends them all and is raised here with that rank's traceback.
    """
    global _pool
    key = (world, cuda, shard)
    if _pool is not None and (_pool.key != key or not _pool.alive()):
        _pool.close()
        _pool = None
    if _pool is None:
        _pool = RankPool(world, cuda=cuda, shard=shard)
    pool = _pool
    try:
        return pool.run(job)
    except BaseException:
        if _pool is pool:
            _pool = None
        pool.close()
        raise


def close_ranks() -> None:
    """Stop the kept rank processes (the trainer child does at exit)."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(close_ranks)
