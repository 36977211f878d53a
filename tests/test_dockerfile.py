"""The Dockerfile without a container engine: two stages, no compiler in the final one, setup.sh's torch pin,
and its torch-install step's shell logic run with pip stubbed out."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILER_PACKAGES = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|[a-z0-9.+-]+-dev)\b")


def stages() -> list[list[tuple[str, str]]]:
    """[(instruction, argument)] per FROM, with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        if op.upper() == "FROM":
            out.append([])
        out[-1].append((op.upper(), arg.strip()))
    return out


def test_two_stages_and_the_final_one_has_no_compilers():
    pre, build, final = stages()
    assert [op for op, _ in pre] == ["ARG"] and build[0][1].endswith("AS build")
    assert any(COMPILER_PACKAGES.search(arg) for op, arg in build if op == "RUN")
    final_runs = [arg for op, arg in final if op == "RUN"]
    assert final_runs and not any(COMPILER_PACKAGES.search(arg) for arg in final_runs), final_runs
    assert ("COPY", "--from=build /opt/shoal /opt/shoal") in final
    assert ("USER", "shoal") in final
    entry = dict(final)["ENTRYPOINT"]
    assert '"shoal", "start", "--data-dir", "/data"' in entry and "--log-json" in entry
    assert "shoal status" in dict(final)["HEALTHCHECK"]


def test_torch_pin_is_shared_with_setup_sh():
    pin = (ROOT / "scripts" / "torch.txt").read_text().strip()
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", pin)
    assert "$(cat scripts/torch.txt)" in (ROOT / "scripts" / "setup.sh").read_text()
    assert any("$(cat scripts/torch.txt)" in arg for op, arg in stages()[1] if op == "RUN")


def test_the_torch_install_step_expands_to_the_pin_and_the_chosen_index(tmp_path):
    run = next(arg for op, arg in stages()[1] if op == "RUN" and "torch.txt" in arg)
    stub = tmp_path / "opt" / "shoal" / "bin"
    stub.mkdir(parents=True)
    (stub / "pip").write_text('#!/bin/sh\necho "pip $*" >> "$LOG"\n')
    (stub / "pip").chmod(0o755)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "torch.txt").write_text((ROOT / "scripts" / "torch.txt").read_text())
    script = run.replace("python3 -m venv /opt/shoal", "true").replace("/opt/shoal/", f"{tmp_path}/opt/shoal/")
    pin = (ROOT / "scripts" / "torch.txt").read_text().strip()
    for index, expect in (("https://download.pytorch.org/whl/cpu", f"--index-url https://download.pytorch.org/whl/cpu"),
                          ("", "")):
        log = tmp_path / f"log{bool(index)}"
        subprocess.run(["sh", "-c", script], cwd=tmp_path, check=True, timeout=30,
                       env={**os.environ, "LOG": str(log), "TORCH_INDEX": index, "TORCH_FIND_LINKS": ""})
        lines = log.read_text().splitlines()
        assert lines[-1].split() == f"pip install --no-cache-dir {pin} {expect}".split(), lines


def test_compose_runs_three_nodes_from_this_image():
    text = (ROOT / "compose.yaml").read_text()
    services = re.findall(r"^  (node\d):$", text.split("\nservices:")[1].split("\nvolumes:")[0], re.M)
    assert services == ["node0", "node1", "node2"]
    assert "--mdns" in text and "mem_limit" in text and "cpus" in text
