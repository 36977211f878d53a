"""The image, built with podman from a locally made base: it runs, has no compiler, respects memory and CPU
limits in `shoal hw`, says one line for an unwritable volume, a node in it answers `shoal status`, and
compose.yaml's three nodes find each other over mDNS."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "shoal:local"
CONF = "[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = \"cgroupfs\"\n"


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory) -> tuple[dict[str, str], list[str]]:
    """The environment (a containers.conf with cgroupfs and no default ulimits) and runtime flags that
    podman needs on this machine's hybrid cgroups, where crun cannot raise rlimits and runc can."""
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}, (["--runtime", "runc"] if shutil.which("runc") else [])


@pytest.fixture(scope="module")
def podman(podman_env):
    if shutil.which("podman") is None or shutil.which("debootstrap") is None:
        pytest.skip("needs podman and debootstrap (apt-get install podman runc debootstrap)")
    env, runtime = podman_env

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


def _peers(podman, container: str) -> tuple[str, dict[str, dict]]:
    """(this node's id, {peer id: row}) from `shoal peers --json`; ("", {}) while it does not answer yet."""
    done = podman("exec", container, "shoal", "peers", "--json", "--data-dir", "/data", check=False)
    if done.returncode:
        return "", {}
    data = json.loads(done.stdout)
    return data["peer_id"], {row["peer_id"]: row for row in data["peers"]}


@pytest.mark.skipif(shutil.which("podman-compose") is None, reason="needs podman-compose (apt-get install podman-compose)")
def test_compose_runs_three_nodes_that_find_each_other_over_mdns(podman, podman_env):
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 9464)) == 0:
            pytest.skip("127.0.0.1:9464, which compose.yaml publishes node0's /metrics on, is taken on this host")
    env, runtime = podman_env
    project = f"shoal-test-{os.getpid()}"
    # The services' `build:` needs download.pytorch.org: they run the image the fixture built instead.
    compose = ["podman-compose", "-f", str(ROOT / "compose.yaml"), "-p", project,
               *([f"--podman-run-args={' '.join(runtime)}"] if runtime else [])]

    def containers() -> dict[str, str]:
        listed = podman("ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
                        "--format", '{{index .Labels "com.docker.compose.service"}} {{.Names}}').stdout
        return dict(line.split() for line in listed.splitlines() if line.strip())

    started = time.monotonic()
    try:
        up = subprocess.run([*compose, "up", "-d", "--no-build"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=180)
        names = containers()
        assert up.returncode == 0 and sorted(names) == ["node0", "node1", "node2"], (names, up.stdout[-3000:],
                                                                                     up.stderr[-3000:])
        deadline = started + 180
        while True:
            seen = {service: _peers(podman, name) for service, name in names.items()}
            ids = {own for own, _ in seen.values()}
            if "" not in ids and len(ids) == 3 and all(
                    set(rows) == ids - {own} and all(r["state"] == "alive" and r["connected"] for r in rows.values())
                    for own, rows in seen.values()):
                break
            if time.monotonic() > deadline:
                logs = {s: podman("logs", "--tail", "20", n, check=False).stderr[-2000:] for s, n in names.items()}
                raise AssertionError(f"after 180 s the nodes saw {seen}; logs: {logs}")
            time.sleep(1)
        print(f"compose: the three nodes saw each other {time.monotonic() - started:.1f} s after `up`")

        token = podman("exec", names["node0"], "cat", "/data/control.token").stdout.strip()
        request = urllib.request.Request("http://127.0.0.1:9464/metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=5) as response:
            metrics = response.read().decode()
        assert 'shoal_peers{state="alive"} 2.0' in metrics and "shoal_connected_peers 2.0" in metrics, metrics[-2000:]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=5)
        assert refused.value.code == 401
    finally:
        subprocess.run([*compose, "down", "-v"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        # podman-compose 1.0.3's `down` leaves the project's network behind.
        for network in podman("network", "ls", "-q", "--filter", f"label=io.podman.compose.project={project}",
                              check=False).stdout.split():
            podman("network", "rm", "-f", network, check=False)
