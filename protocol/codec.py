"""Wire codec: every message is a frozen dataclass encoded as a msgpack array [version, tag, *fields].

Decoding is strict. The size cap is checked before msgpack allocates anything, an unknown
version or tag is a DecodeError, every field is checked against its annotation, and the
message's own invariants (``__post_init__``) run; any failure on bytes from the network is a
RemoteProtocolError subclass, never another exception.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable, TypeVar

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


class _Mismatch(DecodeError):
    """A value that does not match its annotation. Where it sits is added as the error unwinds (``path``, innermost
    first), so a message that decodes builds no location strings at all."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
        self.path: list[str] = []

    def located(self, root: str) -> DecodeError:
        return DecodeError(f"{root}{''.join(reversed(self.path))}: {self.reason}")


@functools.cache
def _checker(hint: Any) -> Callable[[Any], Any]:
    """A function that checks a value against ``hint`` (raising _Mismatch) and converts lists to tuples; built once
    per annotation."""
    if hint is Any:
        return lambda value: value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(option) for option in typing.get_args(hint)]

        def check_union(value):
            for option in options:
                try:
                    return option(value)
                except DecodeError:
                    continue
            raise _Mismatch(f"{type(value).__name__} matches none of {hint}")
        return check_union
    if hint is type(None):
        def check_none(value):
            if value is None:
                return None
            raise _Mismatch("expected nil")
        return check_none
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _checker(args[0])

            def check_sequence(value):
                if not isinstance(value, list):
                    raise _Mismatch(f"expected an array, got {type(value).__name__}")
                try:
                    return tuple([item(v) for v in value])
                except _Mismatch:
                    for i, v in enumerate(value):  # find which item, to say where
                        try:
                            item(v)
                        except _Mismatch as exc:
                            exc.path.append(f"[{i}]")
                            raise exc from None
                    raise
            return check_sequence
        items = [_checker(a) for a in args]

        def check_fixed(value):
            if not isinstance(value, list):
                raise _Mismatch(f"expected an array, got {type(value).__name__}")
            if len(items) != len(value):
                raise _Mismatch(f"expected {len(items)} items, got {len(value)}")
            out = []
            for i, (check, v) in enumerate(zip(items, value)):
                try:
                    out.append(check(v))
                except _Mismatch as exc:
                    exc.path.append(f"[{i}]")
                    raise
            return tuple(out)
        return check_fixed
    if origin is dict:
        key_check, value_check = (_checker(a) for a in typing.get_args(hint))

        def check_map(value):
            if not isinstance(value, dict):
                raise _Mismatch(f"expected a map, got {type(value).__name__}")
            out = {}
            for k, v in value.items():
                try:
                    key = key_check(k)
                except _Mismatch as exc:
                    exc.path.append(" key")
                    raise
                try:
                    out[key] = value_check(v)
                except _Mismatch as exc:
                    exc.path.append(f"[{k!r}]")
                    raise
            return out
        return check_map
    if isinstance(hint, type) and hasattr(hint, "TAG"):
        def check_message(value):
            if not isinstance(value, list) or not value or value[0] != hint.TAG:
                raise _Mismatch(f"expected a {hint.__name__}")
            return _build(hint, value[1:])
        return check_message
    if hint is float:
        def check_float(value):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise _Mismatch(f"expected a float, got {type(value).__name__}")
        return check_float
    if hint is int:
        def check_int(value):
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise _Mismatch(f"expected an int, got {type(value).__name__}")
        return check_int
    if hint in (str, bytes, bool):
        def check_exact(value):
            if type(value) is hint:
                return value
            raise _Mismatch(f"expected {hint.__name__}, got {type(value).__name__}")
        return check_exact
    raise LocalProtocolError(f"unsupported annotation {hint!r}")


def _build(cls: type[M], values: list) -> M:
    fields, defaults = _fields(cls), cls.OPTIONAL_TAIL
    if not len(fields) - len(defaults) <= len(values) <= len(fields):
        raise DecodeError(f"{cls.__name__}: expected {len(fields)} fields, got {len(values)}")
    kwargs = {}
    for (name, hint), v in zip(fields, values):
        try:
            kwargs[name] = _checker(hint)(v)
        except _Mismatch as exc:
            exc.path.append(f".{name}")
            raise
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
    try:
        return _build(cls, raw[2:])
    except _Mismatch as exc:
        raise exc.located(cls.__name__) from None
