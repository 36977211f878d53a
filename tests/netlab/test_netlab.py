"""Netlab builds isolated, shaped hosts, cuts and heals them, and never leaves anything behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import netlab

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.netlab


def leftovers(prefix: str) -> list[str]:
    """Every namespace, root-namespace link or state file that carries the prefix."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [line for line in (namespaces + links).splitlines() if prefix in line]
    return found + [str(p) for p in netlab.STATE_DIR.glob(f"{prefix}*")]


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("text", "bits"), [("50mbit", 50_000_000), ("500kbit", 500_000),
                                             ("1.5gbit", 1_500_000_000), (64_000, 64_000)])
def test_parse_rate_bits(text, bits):
    assert netlab.parse_rate_bits(text) == bits


@pytest.mark.parametrize("text", ["fast", "50mbps", "0", "10kbit extra"])
def test_parse_rate_bits_refuses_nonsense(text):
    with pytest.raises(ValueError):
        netlab.parse_rate_bits(text)


def test_without_root_it_says_why_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netlab.main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "root" in err


def test_create_then_destroy_leaves_nothing(netlab_factory):
    lab = netlab_factory(3)
    assert len(leftovers(lab.prefix)) == 4 + 1  # three hosts and the bridge, plus the state file
    addresses = [h.address for h in lab.hosts]
    assert len(set(addresses)) == 3 and all(a.startswith("10.213.") for a in addresses)
    lab.destroy()
    assert leftovers(lab.prefix) == []


def test_hosts_reach_each_other_over_tcp(netlab_factory):
    lab = netlab_factory(2)
    assert netlab.reachable(lab, "h0", "h1")
    assert netlab.reachable(lab, "h1", "h0")
    shown = lab.run("h0", ["sh", "-c", "echo $NETLAB_ADDRESS"])
    assert shown.stdout.strip() == lab.host("h0").address
    started = lab.exec("h1", ["sh", "-c", "echo $NETLAB_ADDRESS"], stdout=subprocess.PIPE, text=True)
    assert started.communicate(timeout=10)[0].strip() == lab.host("h1").address


def test_cut_blocks_only_that_host_and_heal_restores(netlab_factory):
    lab = netlab_factory(3)
    lab.cut("h1")
    assert lab.status()["hosts"][1]["cut"]
    assert not netlab.reachable(lab, "h0", "h1", timeout_s=1.0)
    assert netlab.reachable(lab, "h0", "h2")
    lab.heal("h1")
    assert not lab.status()["hosts"][1]["cut"]
    assert any(netlab.reachable(lab, "h0", "h1") for _ in range(3))


@pytest.mark.slow
def test_shaped_rate_is_within_15_percent(netlab_factory):
    rate_bits = 50_000_000
    lab = netlab_factory(2, rate=rate_bits)
    measured = netlab.transfer(lab, "h0", "h1", seconds=2.5)
    assert 0.85 <= measured["measured_bits"] / rate_bits <= 1.15


@pytest.mark.slow
def test_download_limit_applies_per_host(netlab_factory):
    lab = netlab_factory(2, rate="50mbit")
    lab.set_rate("h1", up="50mbit", down="20mbit")
    measured = netlab.transfer(lab, "h0", "h1", seconds=2.5)
    assert 0.85 <= measured["measured_bits"] / 20_000_000 <= 1.15


def test_destroy_stale_removes_only_labs_whose_owner_died(netlab_factory):
    live = netlab_factory(1)
    crashed = subprocess.run(
        [sys.executable, "-c", "from scripts.netlab import Lab; print(Lab.create(2).prefix)"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip()
    assert leftovers(crashed) != []
    assert crashed in netlab.stale_prefixes() and live.prefix not in netlab.stale_prefixes()
    assert crashed in netlab.destroy_stale()
    assert leftovers(crashed) == []
    assert len(leftovers(live.prefix)) == 2 + 1


def test_failing_body_still_cleans_up(netlab_session):
    with pytest.raises(RuntimeError, match="the test failed"):
        with netlab.open_lab(2) as lab:
            prefix = lab.prefix
            raise RuntimeError("the test failed")
    assert leftovers(prefix) == []


def test_destroy_stops_processes_inside_the_hosts(netlab_factory):
    lab = netlab_factory(2)
    tracked = lab.exec("h0", ["sleep", "60"])
    # Started through the CLI, so this Lab object never saw its Popen.
    untracked = subprocess.Popen([sys.executable, "scripts/netlab.py", "exec", "--prefix", lab.prefix,
                                  "h1", "--", "sleep", "60"], cwd=REPO_ROOT)
    assert wait_for(lambda: lab.run("h1", ["true"]).returncode == 0 and subprocess.run(
        ["ip", "netns", "pids", lab.host("h1").namespace], capture_output=True, text=True).stdout, 10)
    lab.destroy()
    assert tracked.wait(timeout=10) is not None
    assert untracked.wait(timeout=10) is not None
    assert leftovers(lab.prefix) == []


@pytest.mark.slow
def test_sigterm_during_selftest_removes_its_lab(netlab_session):
    proc = subprocess.Popen([sys.executable, "scripts/netlab.py", "selftest", "--hosts", "2",
                             "--transfer-s", "20"], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)

    def owned_prefixes() -> list[str]:
        states = [netlab._read_state(p.stem) for p in netlab.STATE_DIR.glob("*.json")]
        return [s["prefix"] for s in states if s is not None and s["owner_pid"] == proc.pid]

    try:
        assert wait_for(owned_prefixes, 30)
        prefix = owned_prefixes()[0]
        assert wait_for(lambda: len(leftovers(prefix)) == 3 + 1, 30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert leftovers(prefix) == []


def netlab_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/netlab.py", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_up_cut_heal_status_down(netlab_session):
    up = netlab_cli("up", "--hosts", "2", "--rate", "20mbit", "--owner-pid", str(os.getpid()))
    assert up.returncode == 0, up.stderr
    prefix = json.loads(up.stdout)["prefix"]
    try:
        assert netlab_cli("cut", "--prefix", prefix, "h1").returncode == 0
        labs = {lab["prefix"]: lab for lab in json.loads(netlab_cli("status").stdout)["labs"]}
        assert [h["cut"] for h in labs[prefix]["hosts"]] == [False, True]
        assert labs[prefix]["hosts"][0]["up_bits"] == 20_000_000 and labs[prefix]["owner_alive"]
        assert netlab_cli("heal", "--prefix", prefix, "h1").returncode == 0
        shown = netlab_cli("exec", "--prefix", prefix, "h1", "--", "sh", "-c", "echo $NETLAB_ADDRESS")
        assert shown.stdout.strip() == json.loads(up.stdout)["hosts"]["h1"]
        assert netlab_cli("down", "--prefix", prefix).returncode == 0
        assert leftovers(prefix) == []
    finally:
        if netlab._read_state(prefix) is not None:
            netlab.Lab.attach(prefix).destroy()


def test_cli_names_a_missing_lab_in_one_line(netlab_session):
    result = netlab_cli("cut", "--prefix", "shlzzzzz", "h0")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "shlzzzzz" in result.stderr
