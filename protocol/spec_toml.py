"""Task specs from TOML and plain maps (JSON), and back: the defaults a spec may leave out, every key checked,
and ConfigError naming the bad one."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from typing import Any

from protocol.errors import ConfigError
from protocol.task import (AdamWSpec, AggregationSpec, DatasetSpec, HFSpec, ModelSpec, Requirements, TaskSpec,
                           outer_defaults)

_SUB = {"model": ModelSpec, "dataset": DatasetSpec, "adamw": AdamWSpec, "requirements": Requirements, "hf": HFSpec,
        "aggregation": AggregationSpec}
_OPTIONAL_TABLES: dict[type, set[str]] = {
    TaskSpec: {"model", "hf", "aggregation", "trainers", "overlap", "aggregate_compression", "fragments"},
    DatasetSpec: {"manifest", "heldout_fraction"},
    Requirements: {"torch_version"}, HFSpec: {"method", "seq_len", "lora_r", "lora_alpha", "target_modules", "dpo_beta"},
    AggregationSpec: {"rule", "trim_fraction", "clip_radius", "norm_bound", "spot_check", "screen"},
}
"""Keys a TOML spec may leave out: tables that belong to other recipes, and fields with a default."""
TOML_COMPRESSION, TOML_AGGREGATE_COMPRESSION = "int4", "int4"
"""A TOML spec's compressions when it names none, chosen by scripts/bench_compression.py and bench_diloco.py
(README "Compression"): int4 updates with int4 aggregates halve int8's payload at a loss gap within the
seeds' spread. On the wire the defaults stay int8, so specs sent before keep their ids."""
_DEFAULTS: dict[str, Any] = {
    "recipe": "tiny-lm", "time_budget_s": 0.0,
    "compression": TOML_COMPRESSION, "aggregate_compression": TOML_AGGREGATE_COMPRESSION,
    "aggregation_shards": 2, "aggregators_per_shard": 2, "min_members": 1, "max_members": 64, "seed": 0,
    "created_ms": 0, "round_deadline_s": 120.0, "init_manifest": "",
    "adamw": {"lr": 3e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "warmup_steps": 0},
    "requirements": {"min_memory_bytes": 0, "device": "any"},
    # Chosen by scripts/bench_robust.py (README "Robust aggregation"): the smallest worst case over its attacks,
    # at no cost to honest training.
    "aggregation": {"rule": "centered_clip", "norm_bound": 2.0, "spot_check": 0.05, "screen": True},
}


def _coerce(key: str, value: Any, hint: Any) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint == tuple[str, ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"task spec: {key} must be a list of strings")
        return tuple(value)
    if hint in (int, float, str) and (type(value) is not hint):
        raise ConfigError(f"task spec: {key} = {value!r} must be {'a number' if hint is float else hint.__name__}")
    return value


def _build(cls: type, table: Any, prefix: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"task spec: {prefix.rstrip('.')} must be a table")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ConfigError(f"task spec: unknown key {prefix}{unknown[0]}; known: {', '.join(names)}")
    kwargs = {}
    for name in names:
        key = prefix + name
        if name not in table or (table[name] is None and name in _SUB):
            if cls in _OPTIONAL_TABLES and name in _OPTIONAL_TABLES[cls]:
                continue
            raise ConfigError(f"task spec: missing key {key}")
        if name in _SUB and cls is TaskSpec:
            kwargs[name] = _build(_SUB[name], table[name], key + ".")
        else:
            kwargs[name] = _coerce(key, table[name], hints[name])
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"task spec: {exc}") from None


def spec_from_dict(fields: dict, *, created_ms: int | None = None) -> TaskSpec:
    """A TaskSpec from a plain map (TOML or JSON), defaults filled in; ConfigError names the bad key."""
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in _DEFAULTS.items()}
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(table.get(key), dict):
            table[key] = {**table[key], **value}
        else:
            table[key] = value
    # The outer optimizer's defaults depend on the update compression (protocol.task.outer_defaults).
    compression = table["compression"] if isinstance(table["compression"], str) else ""
    for key, value in zip(("outer_lr", "outer_momentum"), outer_defaults(compression)):
        table.setdefault(key, value)
    if created_ms is not None and not fields.get("created_ms"):
        table["created_ms"] = created_ms
    return _build(TaskSpec, table, "")


TOPK_MOMENTUM_KEPT_FALLING = 0.5
"""The highest outer momentum with which top-k was measured to keep learning from scratch (0.9 diverged)."""


def advice(spec: TaskSpec) -> list[str]:
    """Notes on a valid spec that measured badly (README "Compression"); publishing it is still allowed."""
    notes = []
    if spec.compression == "topk" and spec.outer_momentum > TOPK_MOMENTUM_KEPT_FALLING:
        notes.append(f"compression = \"topk\" with outer_momentum = {spec.outer_momentum}: top-k's error feedback "
                     f"already carries each update into later rounds, and with 0.9 it diverged from scratch; leave "
                     f"outer_lr and outer_momentum out for its defaults ({', '.join(map(str, outer_defaults('topk')))})")
    return notes


def load_spec_toml(text: str, *, created_ms: int | None = None) -> TaskSpec:
    """Parse a task spec from TOML (a top-level [task] table is optional); ConfigError on any mistake."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"task spec is not valid TOML: {exc}") from None
    return spec_from_dict(table.get("task", table), created_ms=created_ms)


def spec_to_dict(spec: TaskSpec) -> dict:
    return dataclasses.asdict(spec)
