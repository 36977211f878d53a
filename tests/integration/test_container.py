"""The image, built with podman from a locally made base: it runs, has no compiler, respects memory and CPU
limits in `shoal hw`, says one line for an unwritable volume, and a node in it answers `shoal status`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "shoal:local"
CONF = "[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = \"cgroupfs\"\n"


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    if shutil.which("podman") is None or shutil.which("debootstrap") is None:
        pytest.skip("needs podman and debootstrap (apt-get install podman runc debootstrap)")
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONF)
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    runtime = ["--runtime", "runc"] if shutil.which("runc") else []

    def run(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["podman", *runtime, *args], capture_output=True, text=True, env=env, timeout=timeout_s)
        if check and done.returncode:
            raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
        return done

    build = subprocess.run(["bash", "scripts/container_build.sh", IMAGE], cwd=ROOT, capture_output=True, text=True,
                           timeout=1500)
    assert build.returncode == 0, build.stderr[-3000:]
    return run


def test_the_image_runs_and_has_no_compiler(podman):
    version = podman("run", "--rm", "--network", "none", "--entrypoint", "shoal", IMAGE, "--version")
    assert version.stdout.startswith("shoal ") and "torch 2." in version.stdout
    found = podman("run", "--rm", "--network", "none", "--entrypoint", "sh", IMAGE, "-c",
                   "command -v gcc cc g++ c++ make || true")
    assert found.stdout.strip() == ""


def test_shoal_hw_respects_the_container_limits(podman):
    done = podman("run", "--rm", "--network", "none", "--memory", "1g", "--cpus", "1", "--entrypoint", "shoal",
                  IMAGE, "hw", "--json", "--no-benchmark")
    report = json.loads(done.stdout)
    assert report["ram"]["total_bytes"] == 2**30, report["ram"]
    assert report["cpu"]["usable_cores"] == 1 and report["limits"]["cpus"] == 1.0, report["cpu"]


def test_an_unwritable_volume_gets_one_line(podman, tmp_path):
    volume = tmp_path / "data"
    volume.mkdir(mode=0o755)  # owned by root; the image's user is uid 1000
    done = podman("run", "--rm", "--network", "none", "-v", f"{volume}:/data", IMAGE, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "not writable" in lines[0], done.stderr


def test_a_node_in_the_container_answers_status_and_metrics(podman):
    name = f"shoal-test-{os.getpid()}"
    podman("run", "-d", "--name", name, "--network", "none", "-e", "SHOAL_HARDWARE_BENCHMARK=false", IMAGE)
    try:
        deadline = time.monotonic() + 120
        while True:
            status = podman("exec", name, "shoal", "status", "--json", "--data-dir", "/data", check=False)
            if status.returncode == 0:
                break
            assert time.monotonic() < deadline, status.stderr
            time.sleep(1)
        assert json.loads(status.stdout)["peer_id"].startswith("12D3KooW")
        scrape = podman("exec", name, "python3", "-c",
                        "import urllib.request as u; t=open('/data/control.token').read().strip(); "
                        "r=u.Request('http://127.0.0.1:9464/metrics', headers={'Authorization': 'Bearer '+t}); "
                        "print(u.urlopen(r, timeout=5).read().decode())")
        assert "shoal_build_info" in scrape.stdout and "process_resident_memory_bytes" in scrape.stdout
        logs = podman("logs", name).stderr.splitlines()
        assert logs and all(isinstance(json.loads(line), dict) for line in logs if line.strip())
    finally:
        podman("rm", "-f", name, check=False)
