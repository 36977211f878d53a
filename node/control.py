"""The control API: a small HTTP/1.1 server on loopback (JSON status, Prometheus metrics, local commands)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import trio

from protocol.errors import ConfigError, ShoalError

log = logging.getLogger("shoal.control")

MAX_REQUEST_BYTES = 64 * 1024
REQUEST_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as exc:
            raise HttpError(400, f"request body is not JSON: {exc}") from None


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def json(cls, value: Any, status: int = 200) -> "Response":
        return cls(status, json.dumps(value, indent=1, default=str).encode() + b"\n")


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


Route = Callable[[Request], Awaitable[Response]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


async def _read_request(conn: trio.SocketStream) -> Request:
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        chunk = await conn.receive_some(8192)
        if not chunk:
            raise HttpError(400, "connection closed before the request was complete")
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise HttpError(413, "request too large")
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError:
        raise HttpError(400, "malformed request line") from None
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HttpError(400, "bad content-length") from None
    if length > MAX_REQUEST_BYTES:
        raise HttpError(413, "request body too large")
    body = bytearray(rest)
    while len(body) < length:
        chunk = await conn.receive_some(8192)
        if not chunk:
            raise HttpError(400, "connection closed mid-body")
        body += chunk
    url = urllib.parse.urlsplit(target)
    return Request(method.upper(), url.path, dict(urllib.parse.parse_qsl(url.query)), bytes(body[:length]))


async def _serve_one(conn: trio.SocketStream, routes: dict[str, Route]) -> None:
    async with conn:
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                request = await _read_request(conn)
            route = routes.get(request.path)
            if route is None:
                raise HttpError(404, f"no such endpoint {request.path}; try /status, /peers or /metrics")
            response = await route(request)
        except HttpError as exc:
            response = Response.json({"error": str(exc)}, exc.status)
        except trio.TooSlowError:
            return
        except ShoalError as exc:
            response = Response.json({"error": str(exc)}, 400)
        except Exception:  # the supervision point for one request: log it, answer 500, keep serving
            log.exception("control API handler failed")
            response = Response.json({"error": "internal error; see the node's log"}, 500)
        head = (f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Error')}\r\n"
                f"Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
                f"Connection: close\r\n\r\n").encode()
        try:
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                await conn.send_all(head + response.body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def serve_control(host: str, port: int, routes: dict[str, Route], *,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; reports the bound port through task_status."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ConfigError(f"control_port = {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                          f"pick another port or 0 for a free one") from None
    bound_port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        task_status.started(bound_port)
        await trio.serve_listeners(lambda conn: _serve_one(conn, routes), listeners, handler_nursery=nursery)


def call(url: str, *, body: Any = None, timeout_s: float = 10.0) -> Any:
    """Blocking client for the CLI: GET (or POST with a JSON body) and decode the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", str(exc))
        except ValueError:
            message = str(exc)
        raise ShoalError(message) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ShoalError(f"cannot reach the node's control API at {url} ({reason}); is `shoal start` running?") from None
