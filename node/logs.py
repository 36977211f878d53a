"""Logging setup: readable lines for people, or one JSON object per line (fields, not text) for log collectors.

In JSON mode everything the process writes to stderr becomes a JSON line, not only what goes through
``logging``: a relay thread reads file descriptor 2 (and so warnings, tracebacks and native libraries' output)
and wraps each line. The trainer child does the same (``TRAINER_LOG_JSON`` in its environment).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Iterator

FIELDS = ("task", "round", "peer", "step", "loss")
CHILD_ENV = "TRAINER_LOG_JSON"
"""Set in the environment the trainer child inherits, so that it writes JSON lines too."""

_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("shoal_log_fields", default={})

# Fields a message names in its text (most of the node's log calls predate structured fields).
_PATTERNS = {
    "round": re.compile(r"\bround[ =](\d+)\b"),
    "step": re.compile(r"\bstep[ =](\d+)\b"),
    "loss": re.compile(r"\bloss[ =](\d+(?:\.\d+)?)\b"),
    "peer": re.compile(r"\b((?:12D3KooW|Qm|16Uiu2)[1-9A-HJ-NP-Za-km-z]{20,})\b"),
    "task": re.compile(r"\btask ([0-9a-f]{12,64})\b"),
}


@contextlib.contextmanager
def log_fields(**fields: Any) -> Iterator[None]:
    """Every record logged inside (and in trio tasks started inside) carries these fields."""
    token = _context.set({**_context.get(), **fields})
    try:
        yield
    finally:
        _context.reset(token)


def fields_of(message: str, explicit: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, pattern in _PATTERNS.items():
        m = pattern.search(message)
        if m:
            value = m.group(1)
            out[key] = float(value) if key == "loss" else int(value) if key in ("round", "step") else value
    out.update(_context.get())
    out.update(explicit or {})
    return out


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        explicit = {k: getattr(record, k) for k in FIELDS if hasattr(record, k)}
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": message, **fields_of(message, explicit)}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def json_line(text: str, *, logger: str, pid: int) -> str | None:
    """One line some code wrote to stderr, as a JSON object line (None for a blank line)."""
    text = text.rstrip("\r\n")
    if not text.strip():
        return None
    try:
        value = json.loads(text)
        if isinstance(value, dict):
            return text
    except ValueError:
        pass
    m = re.match(r"\[trainer (\d+)\] (.*)", text)
    if m:
        pid, text = int(m.group(1)), m.group(2)
    lowered = text.lower()
    level = ("error" if lowered.startswith(("traceback", "error")) or "error:" in lowered
             else "warning" if "warning" in lowered else "info")
    entry = {"ts": round(time.time(), 3), "level": level, "logger": logger, "pid": pid, "msg": text,
             **fields_of(text)}
    return json.dumps(entry, default=str)


def relay_stderr_as_json(logger: str) -> int:
    """Route fd 2 through a thread that writes JSON lines to the real stderr; returns a dup of the real one."""
    real = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pid = os.getpid()
    out = os.fdopen(os.dup(real), "w", buffering=1, encoding="utf-8", errors="replace")

    def pump() -> None:
        with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                wrapped = json_line(line, logger=logger, pid=pid)
                if wrapped is not None:
                    out.write(wrapped + "\n")

    thread = threading.Thread(target=pump, name="stderr-json", daemon=True)
    thread.start()
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")

    def drain() -> None:
        # Close every write end of the pipe this process holds so the pump sees EOF, then let it finish.
        global _drain
        if _drain is None:
            return
        _drain = None
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            pipe_on_stdout = os.path.sameopenfile(1, 2)
            os.dup2(real, 2)
            if pipe_on_stdout:
                os.dup2(real, 1)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.close()
        thread.join(timeout=2.0)
        with contextlib.suppress(OSError, ValueError):
            out.flush()

    global _drain
    _drain = drain
    atexit.register(drain)
    return real


_drain = None


def close_stderr_relay() -> None:
    """Write out what the relay still holds; for a process that leaves with os._exit (no atexit)."""
    if _drain is not None:
        _drain()


class QuietLibp2p(logging.Filter):
    """py-libp2p logs a failed redial of a known peer as ERROR; it is routine (the peer is away), so DEBUG."""

    ROUTINE = ("failed to open tcp stream", "all attempts to connect", "failed to dial", "dial failed",
               "connection refused", "failed to connect", "unable to connect", "all dial attempts failed")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and record.name.startswith("libp2p"):
            text = record.getMessage().lower()
            if any(r in text for r in self.ROUTINE):
                record.levelno, record.levelname = logging.DEBUG, "DEBUG"
                return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def setup_logging(level: str = "info", *, json_lines: bool = False) -> None:
    if json_lines:
        real = relay_stderr_as_json("shoal.node")
        handler: logging.Handler = logging.StreamHandler(os.fdopen(real, "w", buffering=1, encoding="utf-8"))
        handler.setFormatter(JsonFormatter())
        os.environ[CHILD_ENV] = "1"
    else:
        handler = logging.StreamHandler(sys.stderr)
        formatter = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
        os.environ.pop(CHILD_ENV, None)
    handler.addFilter(QuietLibp2p())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # py-libp2p silences its own logger on import; warnings such as dropped messages must reach us.
    libp2p_log = logging.getLogger("libp2p")
    libp2p_log.propagate = True
    libp2p_log.setLevel(max(logging.WARNING, root.level))
    logging.captureWarnings(True)
