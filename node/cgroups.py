"""Memory and CPU limits from cgroup v2 or v1: what a container or systemd slice lets this process use."""

from __future__ import annotations

import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(kw_only=True)
class CgroupLimits:
    """What the container (or systemd slice) allows, which may be less than the host has."""

    version: str = ""  # "v2", "v1", or "" where no cgroup limit could be read
    memory_bytes: int | None = None
    memory_used_bytes: int | None = None
    cpus: float | None = None  # CPU quota over period, e.g. 1.5


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_dirs(root: str, controller: str | None, proc_cgroup: str) -> list[str]:
    """The process's own cgroup directory first, then the root (a container sees its cgroup mounted there)."""
    dirs = []
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (controller is None and hierarchy == "0" and controllers == "") or \
                (controller is not None and controller in controllers.split(",")):
            base = root if controller is None else os.path.join(root, controller)
            dirs.append(os.path.join(base, path.lstrip("/")))
    dirs.append(root if controller is None else os.path.join(root, controller))
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def read_cgroup_limits(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> CgroupLimits:
    """Memory and CPU limits from cgroup v2 (memory.max, cpu.max) or v1 (memory.limit_in_bytes, cfs quota)."""
    def number(text: str | None) -> int | None:
        return int(text) if text is not None and text.lstrip("-").isdigit() else None

    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        limits = CgroupLimits(version="v2")
        for d in _cgroup_dirs(root, None, proc_cgroup):
            mem = number(_read(os.path.join(d, "memory.max")))
            if mem is not None and limits.memory_bytes is None:
                limits.memory_bytes = mem
                limits.memory_used_bytes = number(_read(os.path.join(d, "memory.current")))
            quota, _, period = (_read(os.path.join(d, "cpu.max")) or "").partition(" ")
            if quota.isdigit() and period.isdigit() and int(period) > 0 and limits.cpus is None:
                limits.cpus = int(quota) / int(period)
        return limits
    if not os.path.isdir(os.path.join(root, "memory")) and not os.path.isdir(os.path.join(root, "cpu")):
        return CgroupLimits()
    limits = CgroupLimits(version="v1")
    for d in _cgroup_dirs(root, "memory", proc_cgroup):
        mem = number(_read(os.path.join(d, "memory.limit_in_bytes")))
        if mem is not None and mem < 2**62 and limits.memory_bytes is None:  # "no limit" reads as ~2^63
            limits.memory_bytes = mem
            limits.memory_used_bytes = number(_read(os.path.join(d, "memory.usage_in_bytes")))
    for d in _cgroup_dirs(root, "cpu", proc_cgroup):
        quota = number(_read(os.path.join(d, "cpu.cfs_quota_us")))
        period = number(_read(os.path.join(d, "cpu.cfs_period_us")))
        if quota is not None and quota > 0 and period and limits.cpus is None:
            limits.cpus = quota / period
    return limits
