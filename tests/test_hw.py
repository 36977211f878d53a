"""Hardware detection: real probes on this host, NVML failures and fake GPUs, summary size, rendering."""

import dataclasses
import io
import json
import subprocess
import sys
import types
import warnings

import msgpack
import pytest
from rich.console import Console

from node import hw

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # the pynvml shim warns on import
    import pynvml


@pytest.fixture(scope="module")
def report():
    return hw.detect()


def test_importing_node_hw_loads_neither_torch_nor_pynvml():
    code = "import sys, node.hw; print(sorted({'torch', 'pynvml'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30)
    assert result.stdout.strip() == "[]"


def test_detect_reports_cpu_ram_torch_and_a_positive_cpu_benchmark(report):
    assert report.cpu.physical_cores > 0 and report.cpu.logical_cores >= report.cpu.physical_cores
    assert report.cpu.model and report.cpu.architecture
    assert 0 < report.ram.available_bytes <= report.ram.total_bytes
    cpu = report.torch.devices[0]
    assert cpu.device == "cpu" and cpu.works
    fp32 = [b for b in report.benchmarks if (b.device, b.dtype) == ("cpu", "fp32")]
    assert len(fp32) == 1 and fp32[0].error is None
    assert fp32[0].tflops > 0 and fp32[0].size >= hw.BENCH_START_SIZE and fp32[0].reps >= 1
    assert ("cpu", "bf16") in {(b.device, b.dtype) for b in report.benchmarks} or not cpu.bf16_supported
    # Trials stop once the last few agree, or after BENCH_MAX_BUDGETS budgets; one more allows for the last trial.
    assert all(b.seconds < (hw.BENCH_MAX_BUDGETS + 1) * hw.BENCH_BUDGET_S for b in report.benchmarks)
    assert all(b.trials >= 1 and b.spread is not None for b in report.benchmarks if b.error is None)


def test_gpus_either_listed_or_explained(report):
    if report.gpus:
        assert report.nvml_error is None
    else:
        assert isinstance(report.nvml_error, str) and "NVML" in report.nvml_error
        assert report.gpu_status == report.nvml_error


def test_to_dict_is_plain_json(report):
    data = json.loads(json.dumps(report.to_dict()))
    assert data["cpu"]["logical_cores"] == report.cpu.logical_cores
    assert data["benchmarks"][0]["tflops"] == report.benchmarks[0].tflops


@pytest.mark.parametrize(
    "code, expected",
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 not found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (pynvml.NVML_ERROR_UNKNOWN, "Unknown Error"),
    ],
)
def test_nvml_init_failure_says_why(monkeypatch, code, expected):
    def fail():
        raise pynvml.NVMLError(code)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    gpus, status, error = hw.detect_gpus()
    assert gpus == [] and status == error
    assert error.startswith("NVML not available: ") and expected in error


def test_missing_pynvml_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    gpus, _, error = hw.detect_gpus()
    assert gpus == [] and "pynvml" in error and "nvidia-ml-py" in error


def test_detect_without_nvml_still_reports_everything_else(monkeypatch):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    report = hw.detect(benchmark=False)
    assert report.gpus == [] and "driver is not loaded" in report.nvml_error
    assert report.cpu.logical_cores > 0 and report.ram.total_bytes > 0 and report.torch.version
    assert report.benchmarks == []


class FakeNVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"fake NVML error {value}")
        self.value = value


def fake_pynvml(*, num_gpus=1, power_supported=True, fail_count=False):
    """A pynvml stand-in with H200s, so the GPU path runs on hosts without one."""
    module = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError
    module.NVML_ERROR_NOT_SUPPORTED = 3
    module.NVML_ERROR_GPU_IS_LOST = 15
    module.shutdowns = 0

    def shutdown():
        module.shutdowns += 1

    def count():
        if fail_count:
            raise FakeNVMLError(15)
        return num_gpus

    def power(handle):
        if not power_supported:
            raise FakeNVMLError(3)
        return 700_000

    module.nvmlInit = lambda: None
    module.nvmlShutdown = shutdown
    module.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    module.nvmlSystemGetCudaDriverVersion = lambda: 12040
    module.nvmlDeviceGetCount = count
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetName = lambda handle: "NVIDIA H200"
    module.nvmlDeviceGetUUID = lambda handle: f"GPU-{handle:08d}"
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=143_771_287_552, free=143_000_000_000)
    module.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0)
    module.nvmlDeviceGetPowerManagementLimit = power
    return module


def test_nvml_gpu_fields_and_units(monkeypatch):
    fake = fake_pynvml(num_gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus, status, error = hw.detect_gpus()
    assert error is None and status == "2 NVIDIA GPU(s), driver 550.54.15"
    assert gpus[1] == hw.GpuInfo(
        index=1, name="NVIDIA H200", uuid="GPU-00000001", memory_total_bytes=143_771_287_552,
        memory_free_bytes=143_000_000_000, compute_capability="9.0", driver_version="550.54.15",
        cuda_driver_version="12.4", power_limit_watts=700.0,
    )
    assert fake.shutdowns == 1


def test_unsupported_optional_field_is_none_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(power_supported=False))
    gpus, _, error = hw.detect_gpus()
    assert error is None and gpus[0].power_limit_watts is None and gpus[0].memory_total_bytes > 0


def test_nvml_query_failure_is_reported_and_nvml_shut_down(monkeypatch):
    fake = fake_pynvml(fail_count=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus, _, error = hw.detect_gpus()
    assert gpus == [] and error == "NVML query failed: a GPU fell off the bus or stopped responding"
    assert fake.shutdowns == 1


def test_nvml_sees_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(num_gpus=0))
    gpus, status, error = hw.detect_gpus()
    assert gpus == [] and error is None and "sees no NVIDIA GPU" in status


def test_summary_of_this_host_is_small_and_msgpack_round_trips(report):
    summary = hw.summary(report)
    encoded = msgpack.packb(summary)
    assert len(encoded) < 1024 and msgpack.unpackb(encoded) == summary
    assert summary["memory_bytes"] > 0
    assert summary["tflops"] == max(b.tflops for b in report.benchmarks) > 0
    if not any(d.works for d in report.torch.devices[1:]):
        assert summary == {"devices": ["cpu"], "memory_bytes": report.ram.total_bytes, "tflops": summary["tflops"]}


def gpu_report(report, num_gpus, name="NVIDIA H200"):
    devices = [hw.TorchDevice(device="cpu", name="x", works=True)] + [
        hw.TorchDevice(device=f"cuda:{i}", name=name, works=True, memory_bytes=10 * 2**30, bf16_supported=True)
        for i in range(num_gpus)
    ]
    benchmarks = [hw.BenchResult(device="cuda:0", dtype="bf16", size=8192, reps=50, seconds=0.1, tflops=700.1)]
    return dataclasses.replace(report, torch=dataclasses.replace(report.torch, devices=devices), benchmarks=benchmarks)


def test_summary_of_a_gpu_node_names_gpus_and_sums_their_memory(report):
    summary = hw.summary(gpu_report(report, 2))
    assert summary == {"devices": ["cuda:0 NVIDIA H200", "cuda:1 NVIDIA H200"], "memory_bytes": 20 * 2**30,
                       "tflops": 700.1}


def test_summary_stays_under_1_kib_with_many_long_named_gpus(report):
    summary = hw.summary(gpu_report(report, 64, name="A" * 500))
    assert len(msgpack.packb(summary)) < 1024
    assert len(summary["devices"]) == hw.SUMMARY_MAX_DEVICES


def render_text(report):
    console = Console(file=io.StringIO(), width=160)
    hw.render(report, console)
    return console.file.getvalue()


def test_render_this_host(report):
    text = render_text(report)
    assert "matmul benchmark" in text and "TFLOP/s" in text and report.cpu.model in text
    assert (report.gpu_status in text.replace("\n", " ")) or report.gpus


def test_render_gpus_and_text_that_looks_like_markup(report):
    with_gpu = dataclasses.replace(
        gpu_report(report, 1),
        gpus=[hw.GpuInfo(index=0, name="NVIDIA [/red] H200", uuid="GPU-1", memory_total_bytes=2**30,
                         memory_free_bytes=2**29, compute_capability="9.0", driver_version="550",
                         cuda_driver_version=None, power_limit_watts=None)],
        benchmarks=[hw.BenchResult(device="cuda:0", dtype="bf16", size=128, reps=0, seconds=0.0, tflops=0.0,
                                   error="OutOfMemoryError: [/bold] tried to allocate")],
    )
    text = render_text(with_gpu)
    assert "NVIDIA [/red] H200" in text and "[/bold] tried to allocate" in text and "0.5 GiB / 1.0 GiB" in text


def test_benchmark_failure_becomes_an_error_field(monkeypatch):
    torch = hw._import_torch()

    def broken_matmul(a, b):
        raise RuntimeError("addmm_impl_cpu_ not implemented for 'BFloat16'\nmore detail")

    monkeypatch.setattr(torch, "matmul", broken_matmul)
    result = hw.benchmark_matmul(torch, "cpu", "bf16", budget_s=0.1)
    assert result.error == "RuntimeError: addmm_impl_cpu_ not implemented for 'BFloat16'"
    assert result.tflops == 0.0 and result.reps == 0


def test_cpuinfo_with_two_sockets_and_hyperthreads(tmp_path):
    blocks = [
        f"processor\t: {n}\nmodel name\t: Test CPU 9000\nphysical id\t: {n // 4}\ncore id\t\t: {n % 2}\n"
        for n in range(8)
    ]
    path = tmp_path / "cpuinfo"
    path.write_text("\n".join(blocks))
    cpu = hw.detect_cpu(str(path))
    assert cpu.model == "Test CPU 9000" and cpu.physical_cores == 4


def test_meminfo_in_kib_becomes_bytes_and_missing_proc_falls_back(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 kB\n")
    assert hw.detect_ram(str(path)) == hw.RamInfo(total_bytes=16_000_000 * 1024, available_bytes=8_000_000 * 1024)
    assert hw.detect_ram(str(tmp_path / "absent")).total_bytes > 0


def test_cuda_build_that_cannot_start_cuda_says_why(monkeypatch):
    torch = hw._import_torch()

    def unavailable():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).\nmore")
        return False

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)
    info = hw.detect_torch()
    assert info.error == (
        "torch has CUDA 12.4 but cannot use it: CUDA initialization: "
        "The NVIDIA driver on your system is too old (found version 11040)."
    )
    assert [d.device for d in info.devices] == ["cpu"]


def _tree(root, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_limits_narrow_memory_and_cores(tmp_path):
    _tree(tmp_path, {"cg/cgroup.controllers": "cpu memory", "cg/memory.max": str(2 * 2**30),
                     "cg/memory.current": str(2**29), "cg/cpu.max": "150000 100000", "proc": "0::/\n"})
    limits = hw.read_cgroup_limits(str(tmp_path / "cg"), str(tmp_path / "proc"))
    assert limits == hw.CgroupLimits(version="v2", memory_bytes=2 * 2**30, memory_used_bytes=2**29, cpus=1.5)
    cpu = hw.CpuInfo(model="x", architecture="x86_64", physical_cores=8, logical_cores=16, usable_cores=16)
    cpu, ram = hw.apply_limits(cpu, hw.RamInfo(total_bytes=64 * 2**30, available_bytes=60 * 2**30), limits)
    assert cpu.usable_cores == 2 and ram == hw.RamInfo(total_bytes=2 * 2**30, available_bytes=2**31 - 2**29)


def test_cgroup_v2_without_limits_and_v1_with_them(tmp_path):
    _tree(tmp_path, {"v2/cgroup.controllers": "", "v2/memory.max": "max", "v2/cpu.max": "max 100000",
                     "proc2": "0::/\n"})
    assert hw.read_cgroup_limits(str(tmp_path / "v2"), str(tmp_path / "proc2")) == hw.CgroupLimits(version="v2")
    _tree(tmp_path, {"v1/memory/docker/abc/memory.limit_in_bytes": str(512 * 2**20),
                     "v1/memory/docker/abc/memory.usage_in_bytes": str(100 * 2**20),
                     "v1/cpu/cpu.cfs_quota_us": "-1", "v1/cpu/cpu.cfs_period_us": "100000",
                     "proc1": "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n"})
    limits = hw.read_cgroup_limits(str(tmp_path / "v1"), str(tmp_path / "proc1"))
    assert limits == hw.CgroupLimits(version="v1", memory_bytes=512 * 2**20, memory_used_bytes=100 * 2**20)
    host = hw.RamInfo(total_bytes=2**33, available_bytes=2**32)
    assert hw.apply_limits(hw.detect_cpu(), host, hw.CgroupLimits())[1] == host


def test_benchmark_repeats_until_trials_agree_and_says_when_they_do_not(monkeypatch):
    torch = hw._import_torch()
    # Three calls at 0.6 s stop the size search at once (one warm-up, then a warm-up and a timing at n=128).
    noisy = [0.2, 0.1, 0.3, 0.1, 0.3, 0.2]
    times = iter([0.6] * 3 + noisy + [0.1, 0.101, 0.1])
    monkeypatch.setattr(hw, "_timed", lambda torch, device, a, b, reps: next(times))
    result = hw.benchmark_matmul(torch, "cpu", "fp32", budget_s=10.0)
    assert result.stable and result.trials == len(noisy) + 3 and result.spread <= hw.BENCH_STABLE_SPREAD
    times = iter([0.6] * 3 + noisy * 10)
    result = hw.benchmark_matmul(torch, "cpu", "fp32", budget_s=10.0)
    assert not result.stable and result.trials == hw.BENCH_MAX_TRIALS and result.spread > 0.5 and result.tflops > 0
