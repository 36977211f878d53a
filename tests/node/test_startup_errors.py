"""Each start-up mistake a user can make: a non-zero exit and exactly one line on stderr, no traceback."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from node.config import NodeConfig

ROOT = Path(__file__).resolve().parents[2]
SHOAL = [sys.executable, "-m", "node.cli"]
VALID_ID = "12D3KooWDEAX7Tvp7j3gsuVnFtKjPENghUDT7JzJLLmMDz51FAtz"


def run_start(tmp_path: Path, *args: str, data_dir: Path | None = None, prefix: list[str] = (),
              timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(PYTHONPATH=str(ROOT), SHOAL_HARDWARE_BENCHMARK="false")
    cmd = [*prefix, *SHOAL, "start", "--data-dir", str(data_dir or tmp_path / "data"), "--control-port", "0",
           "--listen", "/ip4/127.0.0.1/tcp/0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    line = lines[0]
    assert line.startswith("shoal: error: "), line
    for needle in needles:
        assert needle in line, line
    return line


def listening_socket(reuse_port: bool) -> socket.socket:
    sock = socket.socket()
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_bad_listen_multiaddr(tmp_path):
    one_line_error(run_start(tmp_path, "--listen", "/ip4/127.0.0.1/tcp/abc"), "listen", "/ip4/127.0.0.1/tcp/abc")


def test_a_quic_only_listen_address_is_refused(tmp_path):
    result = run_start(tmp_path, "--listen", "/ip4/127.0.0.1/udp/4001/quic-v1")
    one_line_error(result, "TCP only")


def test_a_bootstrap_address_with_an_invalid_peer_id(tmp_path):
    one_line_error(run_start(tmp_path, "--bootstrap", "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWinvalid"), "bootstrap")
    one_line_error(run_start(tmp_path, "--bootstrap", "/ip4/127.0.0.1/tcp/4001"), "bootstrap", "/p2p/")


def test_the_control_port_in_use(tmp_path):
    with listening_socket(reuse_port=False) as sock:
        port = sock.getsockname()[1]
        one_line_error(run_start(tmp_path, "--control-port", str(port)), "control port", str(port), "in use")


def test_a_p2p_port_in_use_even_by_a_reuseport_listener(tmp_path):
    """libp2p binds with SO_REUSEPORT, so a second node on the same port would otherwise report ready."""
    with listening_socket(reuse_port=True) as sock:
        port = sock.getsockname()[1]
        result = run_start(tmp_path, "--listen", f"/ip4/127.0.0.1/tcp/{port}")
        one_line_error(result, str(port), "in use")


def test_a_data_dir_locked_by_a_running_node(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    fd = os.open(data_dir / "node.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        one_line_error(run_start(tmp_path, data_dir=data_dir), "already running", str(data_dir))
    finally:
        os.close(fd)


def test_a_data_dir_that_is_a_file(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    one_line_error(run_start(tmp_path, data_dir=path), "data dir", "not a directory")


@pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr to make a directory unwritable")
def test_a_data_dir_not_writable_by_the_user(tmp_path):
    """Made immutable with chattr +i, since root may write anywhere that permission bits forbid."""
    data_dir = tmp_path / "locked-down"
    data_dir.mkdir()
    if subprocess.run(["chattr", "+i", str(data_dir)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem does not support chattr +i")
    try:
        one_line_error(run_start(tmp_path, data_dir=data_dir), "not writable", str(data_dir))
    finally:
        subprocess.run(["chattr", "-i", str(data_dir)], check=True)


def test_a_node_key_readable_by_others(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    key = data_dir / "node.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    one_line_error(run_start(tmp_path, data_dir=data_dir), "chmod 600")


def test_an_unknown_config_key_in_the_environment(tmp_path):
    env_result = subprocess.run([*SHOAL, "start"], capture_output=True, text=True, cwd=ROOT, timeout=60,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "SHOAL_DEAD_AFER_S": "3"})
    one_line_error(env_result, "SHOAL_DEAD_AFER_S", "dead_after_s")


def test_the_projects_own_environment_variables_never_use_the_config_prefix():
    """A SHOAL_* variable is read as a config key by `shoal start`; scripts must not export others."""
    keys = {f"SHOAL_{name.upper()}" for name in NodeConfig.__dataclass_fields__} | {"SHOAL_CONFIG"}
    pattern = re.compile(r"\bSHOAL_[A-Z0-9_]+")
    found = {}
    for path in [ROOT / "README.md", ROOT / "Dockerfile", *ROOT.glob("scripts/*"), *ROOT.glob("docs/*.md"),
                 *ROOT.glob("node/**/*.py"), *ROOT.glob("examples/*")]:
        if path.is_file():
            for name in pattern.findall(path.read_text(errors="replace")):
                if name not in keys:
                    found.setdefault(name, str(path.relative_to(ROOT)))
    assert not found, f"these are not config keys but use the SHOAL_ prefix: {found}"
