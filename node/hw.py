"""What this node can compute with: NVIDIA GPUs via NVML, CPU, RAM, torch devices and a short matmul benchmark."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import platform
import time
import warnings
from dataclasses import dataclass, field

from node.cgroups import CgroupLimits, read_cgroup_limits

# The benchmark must stay short enough to run at daemon start on a small CPU box.
BENCH_BUDGET_S = 0.4  # per (device, dtype)
BENCH_START_SIZE = 128
BENCH_MAX_SIZE = {"cpu": 2048, "cuda": 8192, "mps": 4096}
BENCH_MAX_REPS = 50
BENCH_WINDOW = 3
"""The benchmark's answer is the median of its last BENCH_WINDOW trials once they agree within BENCH_STABLE_SPREAD."""
BENCH_STABLE_SPREAD = 0.05
BENCH_MAX_TRIALS = 12
BENCH_MAX_BUDGETS = 3
"""A noisy machine gets more trials, up to this many times the budget, then the figure says how unsure it is."""
SUMMARY_MAX_DEVICES = 16
SUMMARY_MAX_NAME_CHARS = 40

# NVML error codes worth a precise explanation; anything else shows NVML's own text.
_NVML_REASONS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "libnvidia-ml.so.1 not found — no NVIDIA driver on this host",
    "NVML_ERROR_DRIVER_NOT_LOADED": "the NVIDIA kernel driver is not loaded",
    "NVML_ERROR_NO_PERMISSION": "no permission to open the NVIDIA device files",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "NVML library and kernel driver versions differ — reboot or reinstall",
    "NVML_ERROR_GPU_IS_LOST": "a GPU fell off the bus or stopped responding",
}


@dataclass(kw_only=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int
    compute_capability: str | None  # "9.0"
    driver_version: str
    cuda_driver_version: str | None  # highest CUDA the driver supports, "12.4"
    power_limit_watts: float | None


@dataclass(kw_only=True)
class CpuInfo:
    model: str
    architecture: str
    physical_cores: int
    logical_cores: int
    usable_cores: int  # affinity mask, which containers and taskset narrow


@dataclass(kw_only=True)
class RamInfo:
    total_bytes: int
    available_bytes: int


@dataclass(kw_only=True)
class TorchDevice:
    device: str  # "cpu", "cuda:0", "mps"
    name: str
    works: bool
    error: str | None = None
    memory_bytes: int | None = None
    bf16_supported: bool = False


@dataclass(kw_only=True)
class TorchInfo:
    version: str | None
    cuda_version: str | None  # CUDA that torch was built against; None for CPU builds
    devices: list[TorchDevice] = field(default_factory=list)
    error: str | None = None


@dataclass(kw_only=True)
class BenchResult:
    device: str
    dtype: str  # "fp32" or "bf16"
    size: int  # square matmul side n; one matmul is 2*n^3 FLOP
    reps: int
    seconds: float  # time of the measured reps, warm-up excluded
    tflops: float
    error: str | None = None
    trials: int = 0
    spread: float | None = None  # (max - min) / median of the trials the figure comes from
    stable: bool = False  # the last BENCH_WINDOW trials agreed within BENCH_STABLE_SPREAD


@dataclass(kw_only=True)
class HardwareReport:
    cpu: CpuInfo
    ram: RamInfo
    gpus: list[GpuInfo]
    gpu_status: str
    nvml_error: str | None
    torch: TorchInfo
    benchmarks: list[BenchResult]
    detect_seconds: float
    limits: CgroupLimits = field(default_factory=CgroupLimits)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def detect(*, benchmark: bool = True) -> HardwareReport:
    """Probe the hardware; never raises for missing drivers or devices, it reports why instead."""
    started = time.perf_counter()
    gpus, gpu_status, nvml_error = detect_gpus()
    limits = read_cgroup_limits()
    cpu, ram = apply_limits(detect_cpu(), detect_ram(), limits)
    torch_info = detect_torch(cpu_name=cpu.model)
    benchmarks = run_benchmarks(torch_info) if benchmark else []
    return HardwareReport(
        cpu=cpu, ram=ram, gpus=gpus, gpu_status=gpu_status, nvml_error=nvml_error, torch=torch_info,
        benchmarks=benchmarks, detect_seconds=round(time.perf_counter() - started, 3), limits=limits,
    )


def apply_limits(cpu: CpuInfo, ram: RamInfo, limits: CgroupLimits) -> tuple[CpuInfo, RamInfo]:
    """The host's figures narrowed to what the cgroup allows: what a task may really use here."""
    if limits.memory_bytes is not None and limits.memory_bytes < ram.total_bytes:
        free_in_limit = limits.memory_bytes - (limits.memory_used_bytes or 0)
        ram = RamInfo(total_bytes=limits.memory_bytes,
                      available_bytes=max(0, min(ram.available_bytes, free_in_limit)))
    if limits.cpus is not None:
        cpu = dataclasses.replace(cpu, usable_cores=max(1, min(cpu.usable_cores, math.ceil(limits.cpus))))
    return cpu, ram


def summary(report: HardwareReport) -> dict:
    """The few facts a peer needs to pick workers; small enough for every gossip announcement."""
    accelerators = [d for d in report.torch.devices if d.works and d.device != "cpu"]
    devices = [f"{d.device} {d.name[:SUMMARY_MAX_NAME_CHARS]}".strip() for d in accelerators]
    gpu_memory_bytes = sum(d.memory_bytes or 0 for d in accelerators)
    ok = [b.tflops for b in report.benchmarks if b.error is None]
    return {
        "devices": devices[:SUMMARY_MAX_DEVICES] or ["cpu"],
        "memory_bytes": gpu_memory_bytes or report.ram.total_bytes,
        "tflops": max(ok, default=0.0),
    }


def detect_gpus() -> tuple[list[GpuInfo], str, str | None]:
    """Return (gpus, status line, error); the error says why NVML gave nothing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the "pynvml" shim warns it is deprecated on import
            import pynvml
    except ImportError as error:
        reason = f"NVML not available: cannot import pynvml ({error}) — pip install nvidia-ml-py"
        return [], reason, reason
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        reason = f"NVML not available: {_nvml_reason(pynvml, error)}"
        return [], reason, reason
    try:
        driver_version = str(pynvml.nvmlSystemGetDriverVersion())
        cuda = _optional(pynvml, int, pynvml.nvmlSystemGetCudaDriverVersion)
        cuda_driver_version = None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}"  # 12040 means 12.4
        gpus = [_gpu_info(pynvml, i, driver_version, cuda_driver_version) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as error:
        reason = f"NVML query failed: {_nvml_reason(pynvml, error)}"
        return [], reason, reason
    finally:
        with contextlib.suppress(pynvml.NVMLError):  # nothing left to release if shutdown fails
            pynvml.nvmlShutdown()
    if not gpus:
        return [], f"NVML works (driver {driver_version}) but sees no NVIDIA GPU", None
    return gpus, f"{len(gpus)} NVIDIA GPU(s), driver {driver_version}", None


def _gpu_info(pynvml, index: int, driver_version: str, cuda_driver_version: str | None) -> GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    capability = _optional(pynvml, lambda cc: f"{cc[0]}.{cc[1]}", pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    milliwatts = _optional(pynvml, float, pynvml.nvmlDeviceGetPowerManagementLimit, handle)
    return GpuInfo(
        index=index, name=str(pynvml.nvmlDeviceGetName(handle)), uuid=str(pynvml.nvmlDeviceGetUUID(handle)),
        memory_total_bytes=int(memory.total), memory_free_bytes=int(memory.free), compute_capability=capability,
        driver_version=driver_version, cuda_driver_version=cuda_driver_version,
        power_limit_watts=None if milliwatts is None else milliwatts / 1000,
    )


def _optional(pynvml, convert, query, *args):
    # Some fields are unsupported on some boards (power limit on many consumer GPUs); the rest still counts.
    try:
        return convert(query(*args))
    except pynvml.NVMLError:
        return None


def _nvml_reason(pynvml, error) -> str:
    # A constant missing from an old pynvml keys by its own name, which no error value equals.
    reasons = {getattr(pynvml, constant, constant): reason for constant, reason in _NVML_REASONS.items()}
    return reasons.get(getattr(error, "value", None)) or str(error) or type(error).__name__


def detect_cpu(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    model, physical_id, cores = None, None, set()
    with contextlib.suppress(OSError), open(cpuinfo_path) as file:  # without /proc, platform names the CPU
        for line in file:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and model is None:
                model = value
            elif key == "physical id":
                physical_id = value
            elif key == "core id":
                cores.add((physical_id, value))
    logical_cores = os.cpu_count() or 1
    # macOS has no affinity call; elsewhere containers and taskset narrow the mask.
    usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical_cores
    # ARM and some VMs list no core ids; counting threads is the honest fallback there.
    return CpuInfo(
        model=model or platform.processor() or platform.machine() or "unknown",
        architecture=platform.machine() or "unknown",
        physical_cores=len(cores) or logical_cores, logical_cores=logical_cores, usable_cores=usable_cores,
    )


def detect_ram(meminfo_path: str = "/proc/meminfo") -> RamInfo:
    fields = {}
    with contextlib.suppress(OSError), open(meminfo_path) as file:
        for line in file:
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                fields[key] = int(parts[0]) * 1024  # meminfo counts in KiB
    if "MemTotal" in fields:
        return RamInfo(total_bytes=fields["MemTotal"], available_bytes=fields.get("MemAvailable", 0))
    page_bytes = os.sysconf("SC_PAGE_SIZE")  # no /proc: the OS page counts are the next best source
    total_bytes = page_bytes * os.sysconf("SC_PHYS_PAGES")
    return RamInfo(total_bytes=total_bytes, available_bytes=page_bytes * os.sysconf("SC_AVPHYS_PAGES"))


def _import_torch():
    # Imported here, not at module top, so that importing node.hw at daemon start stays fast.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch imports the deprecated pynvml shim
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
    return torch


def detect_torch(cpu_name: str = "") -> TorchInfo:
    try:
        torch = _import_torch()
    except ImportError as error:
        return TorchInfo(version=None, cuda_version=None, error=f"cannot import torch: {error}")
    devices = [_probe(torch, "cpu", cpu_name)]
    with warnings.catch_warnings(record=True) as caught:  # torch explains a failed CUDA init only as a warning
        warnings.simplefilter("always")
        cuda_available = torch.cuda.is_available()
    if cuda_available:
        for index in range(torch.cuda.device_count()):
            devices.append(_probe_cuda(torch, index))
    if torch.backends.mps.is_available():
        devices.append(_probe(torch, "mps", "Apple GPU", bf16_supported=True))
    error = None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        error = "torch is a CPU-only build; CUDA devices cannot be used"
    elif not cuda_available:
        why = str(caught[0].message).splitlines()[0] if caught else "no driver or no visible GPU"
        error = f"torch has CUDA {torch.version.cuda} but cannot use it: {why}"
    return TorchInfo(version=torch.__version__, cuda_version=torch.version.cuda, devices=devices, error=error)


def _probe_cuda(torch, index: int) -> TorchDevice:
    try:
        properties = torch.cuda.get_device_properties(index)
        with torch.cuda.device(index):
            bf16 = bool(torch.cuda.is_bf16_supported())
    except RuntimeError as error:
        return TorchDevice(device=f"cuda:{index}", name="", works=False, error=_first_line(error))
    return _probe(torch, f"cuda:{index}", properties.name, int(properties.total_memory), bf16_supported=bf16)


def _probe(torch, device: str, name: str, memory_bytes: int | None = None, bf16_supported: bool = False) -> TorchDevice:
    """A device "works" only if a real op on it returns the right answer."""
    error = _op_error(torch, device, torch.float32)
    if device == "cpu":  # CPU bf16 matmul support depends on the torch build, so try it
        bf16_supported = error is None and _op_error(torch, device, torch.bfloat16) is None
    return TorchDevice(device=device, name=name, works=error is None, error=error, memory_bytes=memory_bytes,
                       bf16_supported=bf16_supported)


def _op_error(torch, device: str, dtype) -> str | None:
    try:
        ones = torch.ones(2, 2, device=device, dtype=dtype)
        value = (ones @ ones).float().sum().item()
    except RuntimeError as error:
        return _first_line(error)
    return None if value == 8.0 else f"a 2x2 matmul gave {value}, expected 8.0"


def run_benchmarks(torch_info: TorchInfo, budget_s: float = BENCH_BUDGET_S) -> list[BenchResult]:
    if torch_info.version is None:
        return []
    torch = _import_torch()
    results = []
    for device in torch_info.devices:
        if not device.works:
            continue
        results.append(benchmark_matmul(torch, device.device, "fp32", budget_s))
        if device.bf16_supported:
            results.append(benchmark_matmul(torch, device.device, "bf16", budget_s))
    return results


def benchmark_matmul(torch, device: str, dtype_name: str, budget_s: float) -> BenchResult:
    """Grow n until one matmul is measurable, then repeat it to fill about half the budget."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    max_size = BENCH_MAX_SIZE[device.split(":")[0]]
    size = BENCH_START_SIZE
    try:
        # The first matmul on a device pays one-off setup (cuBLAS handles, thread pools); keep it off the clock.
        warm = torch.ones(8, 8, device=device, dtype=dtype)
        _timed(torch, device, warm, warm, reps=1)
        deadline = time.perf_counter() + budget_s
        while True:
            a = torch.randn(size, size, device=device, dtype=dtype)
            b = torch.randn(size, size, device=device, dtype=dtype)
            _timed(torch, device, a, b, reps=1)  # warm-up for this size: allocator, kernel selection
            seconds = _timed(torch, device, a, b, reps=1)
            # Doubling n costs 8x per matmul, and each size runs twice (warm-up and timing); growth may
            # use the first half of the budget, the repeated measurement the rest.
            next_size_fits = time.perf_counter() + 16 * seconds < deadline - budget_s / 2
            if size >= max_size or seconds >= budget_s / 20 or not next_size_fits:
                break
            size *= 2
        # Trials of equal length until the last few agree: a shared or throttling machine gets more
        # of them (bounded), and the answer says how sure it is.
        trial_s = budget_s / 6
        reps = max(1, min(BENCH_MAX_REPS, int(trial_s / max(seconds, 1e-9))))
        give_up = time.perf_counter() + budget_s * BENCH_MAX_BUDGETS
        rates: list[float] = []
        total_s = 0.0
        while True:
            t = _timed(torch, device, a, b, reps=reps)
            total_s += t
            rates.append(2 * size**3 * reps / max(t, 1e-9) / 1e12)
            window = rates[-BENCH_WINDOW:]
            median = statistics.median(window)
            spread = (max(window) - min(window)) / median if median > 0 else 1.0
            stable = len(window) == BENCH_WINDOW and spread <= BENCH_STABLE_SPREAD
            if stable or len(rates) >= BENCH_MAX_TRIALS or time.perf_counter() > give_up:
                break
    except RuntimeError as error:  # out of memory, or bf16 kernels missing on this device
        return BenchResult(device=device, dtype=dtype_name, size=size, reps=0, seconds=0.0, tflops=0.0,
                           error=_first_line(error))
    # Significant digits, not decimals: a busy or slow CPU still reports a non-zero rate.
    return BenchResult(device=device, dtype=dtype_name, size=size, reps=reps * len(rates), seconds=round(total_s, 4),
                       tflops=float(f"{median:.4g}"), trials=len(rates), spread=round(spread, 4), stable=stable)


def _timed(torch, device: str, a, b, reps: int) -> float:
    # GPU kernels are asynchronous; without synchronizing we would time only the launches.
    synchronize = {"cuda": lambda: torch.cuda.synchronize(device), "mps": lambda: torch.mps.synchronize()}
    synchronize = synchronize.get(device.split(":")[0], lambda: None)
    synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        torch.matmul(a, b)
    synchronize()
    return time.perf_counter() - started


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def render(report: HardwareReport, console) -> None:
    from rich.markup import escape  # names and driver errors may contain [brackets] that rich would eat

    host = _table("Host", show_header=False)
    host.add_row("CPU", escape(f"{report.cpu.model} ({report.cpu.architecture})"))
    cpu = report.cpu
    host.add_row("Cores", f"{cpu.physical_cores} physical, {cpu.logical_cores} logical, {cpu.usable_cores} usable")
    host.add_row("RAM", f"{_gib(report.ram.total_bytes)} total, {_gib(report.ram.available_bytes)} available")
    lim = report.limits
    if lim.memory_bytes is not None or lim.cpus is not None:
        parts = ([f"memory {_gib(lim.memory_bytes)}"] if lim.memory_bytes is not None else []) + \
                ([f"{lim.cpus:g} CPUs"] if lim.cpus is not None else [])
        host.add_row("Limits", f"cgroup {lim.version}: {', '.join(parts)} (the figures above are narrowed to it)")
    host.add_row("torch", f"{report.torch.version or 'missing'} (CUDA {report.torch.cuda_version or 'none'})")
    console.print(host)

    if report.gpus:
        columns = ("#", "Name", "Memory free / total", "Compute", "CUDA (driver)", "Power limit", "UUID")
        gpus = _table(escape(f"NVIDIA GPUs — {report.gpu_status}"), *columns)
        for gpu in report.gpus:
            power = "—" if gpu.power_limit_watts is None else f"{gpu.power_limit_watts:.0f} W"
            memory = f"{_gib(gpu.memory_free_bytes)} / {_gib(gpu.memory_total_bytes)}"
            cuda = gpu.cuda_driver_version or "—"
            capability = gpu.compute_capability or "—"
            gpus.add_row(str(gpu.index), escape(gpu.name), memory, capability, cuda, power, gpu.uuid)
        console.print(gpus)
    else:
        console.print(f"[yellow]No NVIDIA GPU:[/yellow] {escape(report.gpu_status)}")

    devices = _table("torch devices", "Device", "Name", "Works", "bf16", "Note")
    for device in report.torch.devices:
        works = "[green]yes[/green]" if device.works else "[red]no[/red]"
        bf16 = "yes" if device.bf16_supported else "no"
        devices.add_row(device.device, escape(device.name), works, bf16, escape(device.error or ""))
    console.print(devices)
    if report.torch.error:
        console.print(f"[yellow]torch:[/yellow] {escape(report.torch.error)}")

    if report.benchmarks:
        bench = _table("matmul benchmark", "Device", "dtype", "n", "reps", "seconds", "TFLOP/s", "trials", "sure")
        for result in report.benchmarks:
            tflops = f"[red]{escape(result.error)}[/red]" if result.error else f"{result.tflops:.3g}"
            sizes = (str(result.size), str(result.reps), f"{result.seconds:.3f}")
            sure = "-" if result.spread is None else (
                f"±{result.spread * 50:.1f}%" + ("" if result.stable else " [yellow](noisy)[/yellow]"))
            bench.add_row(result.device, result.dtype, *sizes, tflops, str(result.trials), sure)
        console.print(bench)
    console.print(f"detected in {report.detect_seconds:.2f} s")


def _table(title: str, *columns: str, show_header: bool = True):
    from rich.table import Table

    table = Table(title=title, show_header=show_header)
    for column in columns:
        table.add_column(column)
    return table


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"
