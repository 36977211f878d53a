"""Node configuration: defaults < TOML file < SHOAL_* environment < command-line flags, validated in one place."""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node import netaddrs
from protocol.errors import ConfigError
from protocol.manifest import DEFAULT_SHARD_BYTES, MAX_SHARD_BYTES, MIN_SHARD_BYTES
from protocol.messages import KNOWN_ROLES


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "shoal"


@dataclass(kw_only=True)
class NodeConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/4001"])
    announce_addrs: list[str] = field(default_factory=list)
    bootstrap: list[str] = field(default_factory=list)
    mdns: bool = False
    control_host: str = "127.0.0.1"
    control_port: int = 7070
    metrics_listen: str = ""
    """HOST:PORT where /metrics alone is also served (token required), e.g. 0.0.0.0:9464 in a container."""
    publish_dir: str = ""
    """A directory whose files `POST /shard/publish {"path": ...}` may read; unset: files come by upload only."""
    roles: list[str] = field(default_factory=lambda: ["trainer"])
    heartbeat_interval_s: float = 2.0
    suspect_after_s: float = 5.0
    dead_after_s: float = 10.0
    dial_timeout_s: float = 10.0
    bootstrap_retry_s: float = 5.0
    max_peers: int = 64
    gossip_rate_per_s: float = 20.0
    gossip_burst: int = 60
    allowed_initiators: list[str] = field(default_factory=list)
    """Peer ids whose tasks this node accepts; empty accepts any signed task."""
    max_tasks: int = 2
    """Tasks this node runs at once (each has its own trainer process); more are declined."""
    hardware_benchmark: bool = True
    train_processes: int = 0
    """Local processes for a round's inner steps (node/train/ranks.py); 0: one per CUDA device when the task may
    use one, else 1. On the CPU more than 1 only splits the same cores (it is how the multi-rank path is tested)."""
    train_sharding: str = "auto"
    """With several local ranks: "replicate" (each rank holds the whole model), "shard" (FSDP: each holds
    1/ranks of the weights, gradients and AdamW state), or "auto": shard on CUDA when a task's training
    memory estimate passes 80% of the smallest local GPU's memory."""
    shard_single_source: bool = False
    """Fetch shards only from the manifest's publisher (a baseline for benchmarks, not for real swarms)."""
    shard_bytes: int = DEFAULT_SHARD_BYTES
    """Shard size for files this node publishes; smaller shards spread sooner, larger ones cost less per byte."""
    nat: bool = True
    """Learn reachability from peers' dial-backs; behind NAT, reserve relay slots and punch holes."""
    relay_service: bool = True
    """Serve as a limited circuit relay (control traffic only) once peers confirm this node is public."""
    port_mapping: bool = False
    """Ask the home router (NAT-PMP, then UPnP IGD) to forward the listen port; peers' dial-backs still decide
    whether the node is public. Off by default: it sends UDP and HTTP to the default gateway."""
    port_mapping_gateway: str = ""
    """The router to ask, IP or IP:PORT (NAT-PMP's port, 5351 by default); empty: the default route's gateway."""
    log_json: bool = False
    log_level: str = "info"

    def validate(self) -> "NodeConfig":
        def need(ok: bool, key: str, fix: str) -> None:
            if not ok:
                raise ConfigError(f"{key} = {getattr(self, key)!r}: {fix}")

        need(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be a positive number of seconds")
        need(self.suspect_after_s > self.heartbeat_interval_s, "suspect_after_s",
             "must be longer than heartbeat_interval_s, or live peers flap to suspect")
        need(self.dead_after_s >= self.suspect_after_s, "dead_after_s", "must be at least suspect_after_s")
        need(self.dial_timeout_s > 0, "dial_timeout_s", "must be a positive number of seconds")
        need(self.bootstrap_retry_s > 0, "bootstrap_retry_s", "must be a positive number of seconds")
        need(0 <= self.control_port <= 65535, "control_port", "must be a TCP port (0 picks a free one)")
        need(self.control_host in ("127.0.0.1", "::1", "localhost"), "control_host",
             "the control API binds to loopback only: use 127.0.0.1 (metrics_listen exposes /metrics elsewhere)")
        if self.metrics_listen:
            host, _, port = self.metrics_listen.rpartition(":")
            need(bool(host) and port.isdigit() and int(port) <= 65535, "metrics_listen",
                 "must be HOST:PORT, e.g. 0.0.0.0:9464")
        need(1 <= self.max_peers <= 10_000, "max_peers", "must be between 1 and 10000")
        need(1 <= self.max_tasks <= 64, "max_tasks", "must be between 1 and 64")
        need(0 <= self.train_processes <= 64, "train_processes",
             "must be between 0 (one per GPU) and 64")
        need(self.train_sharding in ("auto", "replicate", "shard"), "train_sharding",
             "must be auto, replicate or shard")
        need(self.gossip_rate_per_s > 0 and self.gossip_burst >= 1, "gossip_rate_per_s",
             "the gossip flood limit needs a positive rate and a burst of at least 1")
        need(MIN_SHARD_BYTES <= self.shard_bytes <= MAX_SHARD_BYTES, "shard_bytes",
             f"must be between {MIN_SHARD_BYTES} and {MAX_SHARD_BYTES} bytes")
        gateway_problem = netaddrs.ipv4_port_problem(self.port_mapping_gateway) if self.port_mapping_gateway else None
        need(gateway_problem is None, "port_mapping_gateway",
             f"{gateway_problem}; e.g. 192.168.1.1 or 192.168.1.1:5351")
        need(bool(self.listen), "listen", "give at least one multiaddr, e.g. /ip4/0.0.0.0/tcp/4001")
        for addr in self.listen:
            problem = netaddrs.listen_problem(addr)
            need(problem is None, "listen", f"{addr!r}: {problem}")
        for addr in self.announce_addrs:
            problem = netaddrs.multiaddr_problem(addr)
            need(problem is None, "announce_addrs", f"{addr!r}: {problem}")
        for addr in self.bootstrap:
            problem = netaddrs.dial_problem(addr)
            need(problem is None, "bootstrap", f"{addr!r}: {problem}")
        for peer_id in self.allowed_initiators:
            need(netaddrs.is_peer_id(peer_id), "allowed_initiators",
                 f"{peer_id!r} is not a peer id (as `shoal id` prints it)")
        unknown = set(self.roles) - KNOWN_ROLES
        need(not unknown, "roles", f"unknown role(s) {sorted(unknown)}; choose from {sorted(KNOWN_ROLES)}")
        need(self.log_level in ("debug", "info", "warning", "error"), "log_level",
             "choose debug, info, warning or error")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}


_FIELDS = {f.name: f for f in dataclasses.fields(NodeConfig)}
_HINTS = typing.get_type_hints(NodeConfig)


def _coerce(key: str, value: Any, source: str) -> Any:
    hint = _HINTS[key]
    try:
        if hint is Path:
            if not isinstance(value, (str, Path)):
                raise TypeError
            return Path(value).expanduser()
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
            raise TypeError
        if hint is int:
            if isinstance(value, bool):
                raise TypeError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if hint is str:
            if not isinstance(value, str):
                raise TypeError
            return value
        if typing.get_origin(hint) is list:
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return list(value)
            raise TypeError
    except (TypeError, ValueError):
        pass
    else:
        raise AssertionError(f"unhandled config type {hint}")
    kind = {Path: "a path", bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, "a list of strings")
    raise ConfigError(f"{key} = {value!r} ({source}): must be {kind}")


def _unknown(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, _FIELDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(_FIELDS))}"
    return ConfigError(f"unknown config key {key!r} ({source}){hint}")


def load_config(*, path: Path | None = None, env: dict[str, str] | None = None,
                flags: dict[str, Any] | None = None) -> NodeConfig:
    """Build the config from every source; raises ConfigError with one line naming the key and the fix."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass an existing file to --config") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        table = table.get("node", table)
        for key, value in table.items():
            if key not in _FIELDS:
                raise _unknown(key, str(path))
            values[key] = _coerce(key, value, str(path))
    env = os.environ if env is None else env
    for name, value in env.items():
        if not name.startswith("SHOAL_") or name in ("SHOAL_CONFIG",):
            continue
        key = name[len("SHOAL_"):].lower()
        if key not in _FIELDS:
            raise _unknown(key, f"environment variable {name}")
        values[key] = _coerce(key, value, f"environment variable {name}")
    for key, value in (flags or {}).items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise _unknown(key, "command line")
        values[key] = _coerce(key, value, "command line")
    return NodeConfig(**values).validate()
