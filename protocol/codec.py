"""Wire codec: every message is a frozen dataclass encoded as a msgpack array [version, tag, *fields].

Decoding is strict. The size cap is checked before msgpack allocates anything, an unknown
version or tag is a DecodeError, every field is checked against its annotation, and the
message's own invariants (``__post_init__``) run; any failure on bytes from the network is a
RemoteProtocolError subclass, never another exception.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

import msgpack

from protocol import PROTOCOL_VERSION
from protocol.errors import DecodeError, LocalProtocolError, OversizeError

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024
"""Cap for one control message; gossip stays far below py-libp2p's 1 MiB RPC limit."""

_REGISTRY: dict[int, type] = {}
_HINTS: dict[type, list[tuple[str, Any]]] = {}

M = TypeVar("M")


def message(tag: int, *, optional_tail: tuple[str, ...] = ()):
    """Register a frozen dataclass as a wire message with a fixed tag.

    ``optional_tail`` names the message's last fields (each with a default) that were added after it
    first went on the wire: they are left off the end of the encoding while they hold their default,
    so a message that does not use them encodes, and hashes, exactly as before they existed."""

    def register(cls: type[M]) -> type[M]:
        if tag in _REGISTRY and _REGISTRY[tag] is not cls:
            raise LocalProtocolError(f"message tag {tag} used by {_REGISTRY[tag].__name__} and {cls.__name__}")
        assert dataclasses.is_dataclass(cls), f"{cls.__name__} must be a dataclass"
        fields = dataclasses.fields(cls)
        tail = fields[len(fields) - len(optional_tail):] if optional_tail else ()
        assert tuple(f.name for f in tail) == tuple(optional_tail), f"{cls.__name__}: optional_tail must be its last fields"
        assert all(f.default is not dataclasses.MISSING for f in tail), "optional_tail fields need defaults"
        cls.TAG = tag  # type: ignore[attr-defined]
        cls.OPTIONAL_TAIL = tuple(f.default for f in tail)  # type: ignore[attr-defined]
        _REGISTRY[tag] = cls
        return cls

    return register


def _fields(cls: type) -> list[tuple[str, Any]]:
    hints = _HINTS.get(cls)
    if hints is None:
        resolved = typing.get_type_hints(cls)
        hints = [(f.name, resolved[f.name]) for f in dataclasses.fields(cls)]
        _HINTS[cls] = hints
    return hints


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and hasattr(value, "TAG"):
        values = [getattr(value, name) for name, _ in _fields(type(value))]
        defaults, keep = type(value).OPTIONAL_TAIL, len(values)
        while defaults and keep > len(values) - len(defaults) and values[keep - 1] == defaults[keep - 1 - len(values)]:
            keep -= 1
        return [value.TAG, *(_to_wire(v) for v in values[:keep])]
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def encode(msg: Any) -> bytes:
    """Encode a registered message as ``[version, tag, *fields]``."""
    if not hasattr(type(msg), "TAG"):
        raise LocalProtocolError(f"{type(msg).__name__} is not a registered message")
    wire = _to_wire(msg)
    return msgpack.packb([PROTOCOL_VERSION, *wire], use_bin_type=True)


def _check(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a type annotation and convert lists to tuples."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check(value, option, where)
            except DecodeError:
                continue
        raise DecodeError(f"{where}: {type(value).__name__} matches none of {hint}")
    if hint is type(None):
        if value is None:
            return None
        raise DecodeError(f"{where}: expected nil")
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, list):
            raise DecodeError(f"{where}: expected an array, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise DecodeError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_check(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(args, value)))
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        if not isinstance(value, dict):
            raise DecodeError(f"{where}: expected a map, got {type(value).__name__}")
        return {_check(k, key_t, f"{where} key"): _check(v, val_t, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(hint, type) and hasattr(hint, "TAG"):
        if not isinstance(value, list) or not value or value[0] != hint.TAG:
            raise DecodeError(f"{where}: expected a {hint.__name__}")
        return _build(hint, value[1:], where)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise DecodeError(f"{where}: expected a float, got {type(value).__name__}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise DecodeError(f"{where}: expected an int, got {type(value).__name__}")
    if hint in (str, bytes, bool):
        if type(value) is hint:
            return value
        raise DecodeError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    raise LocalProtocolError(f"{where}: unsupported annotation {hint!r}")


def _build(cls: type[M], values: list, where: str) -> M:
    fields, defaults = _fields(cls), cls.OPTIONAL_TAIL
    if not len(fields) - len(defaults) <= len(values) <= len(fields):
        raise DecodeError(f"{cls.__name__}: expected {len(fields)} fields, got {len(values)}")
    kwargs = {name: _check(v, hint, f"{where}.{name}") for (name, hint), v in zip(fields, values)}
    if len(values) > len(fields) - len(defaults) and kwargs[fields[len(values) - 1][0]] == \
            defaults[len(values) - 1 - len(fields)]:
        # The encoder leaves a default tail off: one spelling per message, so one hash per message.
        raise DecodeError(f"{cls.__name__}: {fields[len(values) - 1][0]} sent with its default value")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise DecodeError(f"{cls.__name__}: {exc}") from exc


def _refuse_ext(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack extension type {code} is not allowed")


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
           expect: type[M] | tuple[type, ...] | None = None) -> M:
    """Decode one message, refusing anything malformed, oversized or unexpected."""
    if len(data) > max_bytes:
        raise OversizeError(f"message of {len(data)} bytes exceeds the cap of {max_bytes}")
    try:
        raw = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, ext_hook=_refuse_ext,
            max_str_len=max_bytes, max_bin_len=max_bytes,
            max_array_len=max_bytes, max_map_len=max_bytes,
        )
    except DecodeError:
        raise
    except Exception as exc:  # msgpack raises many kinds: ExtraData, FormatError, StackError, ValueError...
        raise DecodeError(f"malformed msgpack: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise DecodeError("a message must be an array [version, tag, *fields]")
    version, tag = raw[0], raw[1]
    if version != PROTOCOL_VERSION:
        raise DecodeError(f"unsupported protocol version {version!r} (this node speaks {PROTOCOL_VERSION})")
    cls = _REGISTRY.get(tag) if isinstance(tag, int) and not isinstance(tag, bool) else None
    if cls is None:
        raise DecodeError(f"unknown message tag {tag!r}")
    if expect is not None and not issubclass(cls, expect):
        raise DecodeError(f"unexpected {cls.__name__}")
    return _build(cls, raw[2:], cls.__name__)
