"""Config precedence and one-line errors; the identity key file and its permissions."""

import os
import stat
import subprocess
import sys

import pytest

from node import identity
from node.config import load_config
from protocol.errors import ConfigError


def test_flags_beat_environment_beat_file(tmp_path):
    path = tmp_path / "shoal.toml"
    path.write_text('heartbeat_interval_s = 3.0\ndead_after_s = 30.0\nbootstrap = ["/ip4/1.2.3.4/tcp/1/p2p/12D3KooWDEAX7Tvp7j3gsuVnFtKjPENghUDT7JzJLLmMDz51FAtz"]\n')
    cfg = load_config(path=path, env={"SHOAL_DEAD_AFTER_S": "20"}, flags={"dead_after_s": 15.0, "mdns": None})
    assert cfg.heartbeat_interval_s == 3.0  # file
    assert cfg.dead_after_s == 15.0  # flag over env over file
    assert cfg.bootstrap == ["/ip4/1.2.3.4/tcp/1/p2p/12D3KooWDEAX7Tvp7j3gsuVnFtKjPENghUDT7JzJLLmMDz51FAtz"]
    assert load_config(path=path, env={"SHOAL_DEAD_AFTER_S": "20"}).dead_after_s == 20.0


def test_a_node_table_in_the_file_is_accepted(tmp_path):
    path = tmp_path / "shoal.toml"
    path.write_text("[node]\nmax_peers = 12\n")
    assert load_config(path=path, env={}).max_peers == 12


@pytest.mark.parametrize("text, match", [
    ("heartbeat_intervl_s = 1", "did you mean 'heartbeat_interval_s'"),
    ("heartbeat_interval_s = 'fast'", "heartbeat_interval_s = 'fast'.*must be a number"),
    ("dead_after_s = 1.0", "dead_after_s = 1.0: must be at least suspect_after_s"),
    ("control_host = '0.0.0.0'", "loopback only"),
    ("bootstrap = ['/ip4/1.2.3.4/tcp/1']", "/p2p/<peer id> suffix"),
    ("roles = ['emperor']", "unknown role"),
    ("port_mapping_gateway = 'router.local'", "'router.local' is not an IPv4 address; e.g. 192.168.1.1"),
    ("port_mapping_gateway = '192.168.1.1:99999'", "'99999' is not a UDP port"),
    ("port_mapping = 'sometimes'", "port_mapping"),
    ("train_sharding = 'fsdp'", "train_sharding = 'fsdp'.*must be auto, replicate or shard"),
    ("this is not toml", "not valid TOML"),
])
def test_wrong_values_name_the_key_and_the_fix(tmp_path, text, match):
    path = tmp_path / "shoal.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path=path, env={})


def test_train_sharding_comes_from_the_environment_too():
    assert load_config(env={}).train_sharding == "auto"
    assert load_config(env={"SHOAL_TRAIN_SHARDING": "shard"}).train_sharding == "shard"


def test_wrong_environment_variable_is_named():
    with pytest.raises(ConfigError, match="SHOAL_MDNS"):
        load_config(env={"SHOAL_MDNS": "perhaps"})
    with pytest.raises(ConfigError, match="unknown config key 'dead_afer_s'.*SHOAL_DEAD_AFER_S"):
        load_config(env={"SHOAL_DEAD_AFER_S": "3"})


def test_identity_is_created_private_and_stable(tmp_path):
    first = identity.load_or_create(tmp_path)
    assert stat.S_IMODE((tmp_path / identity.KEY_FILE).stat().st_mode) == 0o600
    assert identity.load_or_create(tmp_path).peer_id == first.peer_id


def test_identity_readable_by_others_is_refused_with_the_fix(tmp_path):
    identity.load_or_create(tmp_path)
    os.chmod(tmp_path / identity.KEY_FILE, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        identity.load_or_create(tmp_path)


def test_damaged_identity_says_what_to_do(tmp_path):
    (tmp_path / identity.KEY_FILE).write_bytes(b"short")
    os.chmod(tmp_path / identity.KEY_FILE, 0o600)
    with pytest.raises(ConfigError, match="damaged"):
        identity.load_or_create(tmp_path)


def shoal(*args, env=None):
    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_cli_user_mistakes_get_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("dead_after_s = -1\n")
    for result in (shoal("start", "--config", str(bad), "--data-dir", str(tmp_path)),
                   shoal("start", "--data-dir", str(tmp_path), "--bootstrap", "/ip4/1.2.3.4/tcp/1"),
                   shoal("status", "--data-dir", str(tmp_path / "nothing-here"))):
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("shoal: error: ")
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_cli_id_prints_a_peer_id(tmp_path):
    result = shoal("id", "--data-dir", str(tmp_path))
    assert result.returncode == 0
    assert result.stdout.startswith("12D3KooW")


def test_cli_hw_json_reports_the_cpu():
    import json
    result = shoal("hw", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["cpu"]["logical_cores"] >= 1
    assert any(b["tflops"] > 0 for b in report["benchmarks"] if b["dtype"] == "fp32")
