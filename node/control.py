"""The control API: token-guarded HTTP on loopback (and a Unix socket) for the CLI and the dashboard, on hypercorn.

What a request must carry, checked in this order by ``ControlApp`` (the one seam between HTTP and the node):

- over TCP, a Host header naming this node on loopback (``127.0.0.1:PORT``, ``localhost:PORT``, ``[::1]:PORT``):
  a DNS-rebinding page reaches the port under its own host name, so it is refused here;
- no Origin header, or this node's own origin: a page from any other origin is refused before any route runs;
- ``Authorization: Bearer <token>``, the token kept in ``<data_dir>/control.token`` (mode 0600);
- for every method but GET and HEAD, ``Content-Type: application/json``: a browser sends a cross-origin
  ``text/plain``, form or multipart POST without asking first (no CORS preflight), JSON it never sends unasked.

No response carries CORS headers, so a browser never lets another origin read an answer either.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import os
import secrets
import socket
import stat
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import trio

from protocol.errors import ConfigError, ShoalError

log = logging.getLogger("shoal.control")

TOKEN_FILE = "control.token"
SOCKET_FILE = "control.sock"
MAX_BODY_BYTES = 16 * 2**20
"""Big enough for one upload chunk (8 MiB, base64 in JSON); anything larger is refused before it is read."""
MAX_HEADER_BYTES = 16 * 1024
KEEP_ALIVE_S = 5.0
SAFE_METHODS = frozenset({"GET", "HEAD"})
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as exc:
            raise HttpError(400, f"request body is not JSON: {exc}") from None


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    stream: Callable[[], AsyncIterator[bytes]] | None = None
    """Set for a streamed answer (server-sent events): its chunks are sent as they come, body is ignored."""

    @classmethod
    def json(cls, value: Any, status: int = 200) -> "Response":
        return cls(status, json.dumps(value, indent=1, default=str).encode() + b"\n")


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Refused(HttpError):
    """A request the guards turned away before any route ran; ``reason`` labels the refusal counter."""

    def __init__(self, status: int, message: str, reason: str):
        super().__init__(status, message)
        self.reason = reason


Route = Callable[[Request], Awaitable[Response]]


# -- the token ------------------------------------------------------------------------------------

def _token_ok(text: str) -> bool:
    return len(text) >= 32 and all(c.isalnum() or c in "-_" for c in text)


def ensure_token(data_dir: Path) -> str:
    """The node's control token, created (mode 0600) when missing or when others could read it."""
    path = data_dir / TOKEN_FILE
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o077:
            existing = path.read_text().strip()
            if _token_ok(existing):
                return existing
        log.warning("replacing %s: it was readable by others or damaged", path)
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def read_token(data_dir: Path) -> str:
    path = data_dir / TOKEN_FILE
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"no control token at {path}; start the node with `shoal start --data-dir {data_dir}`, "
                          f"or pass the --data-dir of the node you mean") from None
    except PermissionError:
        raise ConfigError(f"cannot read {path}: run this as the user that runs the node") from None
    if not _token_ok(token):
        raise ConfigError(f"{path} is damaged; restart the node to write a new token")
    return token


# -- the ASGI app: the one seam between HTTP and the node's routes ---------------------------------

def loopback_hosts(port: int) -> frozenset[str]:
    return frozenset(f"{name}:{port}" for name in LOOPBACK_NAMES)


class ControlApp:
    """ASGI app: admit a request (see the module docstring), run its route, send the answer."""

    def __init__(self, routes: Mapping[str, Route], *, token: str, hosts: frozenset[str] | None,
                 only: frozenset[str] | None = None, page_paths: frozenset[str] = frozenset({"/"}),
                 refused: Counter[str] | None = None):
        self.routes, self.token, self.hosts, self.only = routes, token, hosts, only
        self.refused = Counter() if refused is None else refused
        self.origins = None if hosts is None else frozenset(f"http://{h}" for h in hosts)
        self.page_paths = page_paths
        """Paths a browser opens by URL, so the token may come as ?token= (a page's own requests send the header)."""

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return  # no websockets: hypercorn closes the connection
        try:
            request = await self._admit(scope, receive)
            route = self.routes.get(request.path) if self.only is None or request.path in self.only else None
            if route is None:
                raise HttpError(404, f"no such endpoint {request.path}; try /status, /peers or /metrics")
            response = await route(request)
        except Refused as exc:
            self.refused[exc.reason] += 1
            response = Response.json({"error": str(exc)}, exc.status)
        except HttpError as exc:
            response = Response.json({"error": str(exc)}, exc.status)
        except ShoalError as exc:
            response = Response.json({"error": str(exc)}, 400)
        except Exception:  # the supervision point for one request: log it, answer 500, keep serving
            log.exception("control API handler failed")
            response = Response.json({"error": "internal error; see the node's log"}, 500)
        await _send(response, send, receive)

    async def _admit(self, scope: dict, receive) -> Request:
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name = raw_name.decode("latin-1").lower()
            if name in headers and name in ("host", "authorization", "origin", "content-type", "content-length"):
                raise Refused(400, f"more than one {name} header", "duplicate_header")
            headers[name] = raw_value.decode("latin-1")
        if self.hosts is not None and headers.get("host", "").lower() not in self.hosts:
            raise Refused(403, "the Host header must name this node on loopback "
                                 "(127.0.0.1:PORT, localhost:PORT or [::1]:PORT)", "host")
        origin = headers.get("origin")
        if origin is not None and self.origins is not None and origin.lower() not in self.origins:
            raise Refused(403, f"requests from other origins ({origin}) are refused", "origin")
        method, path = scope["method"].upper(), scope["path"]
        query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if method == "OPTIONS":
            raise Refused(405, "no cross-origin access: the control API answers no preflight", "options")
        auth = headers.get("authorization", "")
        supplied = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not supplied and method == "GET" and path in self.page_paths:
            supplied = query.pop("token", "")
        if not hmac.compare_digest(supplied.encode(), self.token.encode()):
            raise Refused(401, f"missing or wrong control token: send 'Authorization: Bearer <token>' "
                                 f"with the token from the node's {TOKEN_FILE}", "token")
        if method not in SAFE_METHODS:
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                raise Refused(415, f"{method} requests must be Content-Type: application/json", "content_type")
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise HttpError(400, "bad content-length") from None
        if length > MAX_BODY_BYTES:
            raise HttpError(413, f"request body too large (at most {MAX_BODY_BYTES} bytes)")
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(400, "connection closed mid-request")
            body += message.get("body", b"")
            if len(body) > MAX_BODY_BYTES:
                raise HttpError(413, f"request body too large (at most {MAX_BODY_BYTES} bytes)")
            if not message.get("more_body", False):
                break
        return Request(method, path, query, bytes(body), headers)


_COMMON_HEADERS = [(b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"),
                   (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY")]


async def _send(response: Response, send, receive) -> None:
    headers = [(b"content-type", response.content_type.encode()), *_COMMON_HEADERS,
               *((k.encode(), v.encode()) for k, v in response.headers)]
    if response.stream is None:
        headers.append((b"content-length", str(len(response.body)).encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})
        return
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    async with trio.open_nursery() as nursery:
        async def stop_on_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        async def pump() -> None:
            async for chunk in response.stream():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop_on_disconnect)
        nursery.start_soon(pump)
    with trio.move_on_after(1.0, shield=True):
        await send({"type": "http.response.body", "body": b""})


# -- serving --------------------------------------------------------------------------------------

def _bind_tcp(host: str, port: int, key: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart through TIME_WAIT; never REUSEPORT
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{key}: cannot listen on {host}:{port} ({exc.strerror}); "
                          f"pick another port or 0 for a free one") from None
    return sock


def _short_unix_path(path: Path, dir_fd: int) -> str:
    # sun_path holds 108 bytes; a deep data dir is reached through the directory's fd instead.
    return str(path) if len(os.fsencode(path)) < 100 else f"/proc/self/fd/{dir_fd}/{path.name}"


def _bind_unix(path: Path) -> socket.socket:
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # left by a node that died: the data dir's lock says none is running now
        except FileNotFoundError:
            pass
        sock.bind(_short_unix_path(path, dir_fd))
        os.chmod(path, 0o600)  # bound with the umask's mode (no write bit for others), narrowed before listen
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot create the control socket {path} ({exc.strerror})") from None
    finally:
        os.close(dir_fd)
    return sock


def parse_listen(text: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); ValueError if it is neither."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


async def _serve_socket(sock: socket.socket, app: ControlApp, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    http_log = logging.getLogger("shoal.control.http")
    http_log.setLevel(max(logging.WARNING, logging.getLogger().level))  # not its "Running on ..." banner
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = http_log
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.graceful_timeout = 1.0
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.include_server_header = False
    await serve(app, config, task_status=task_status)


async def serve_control(host: str, port: int, routes: Mapping[str, Route], *, token: str,
                        unix_path: Path | None = None, metrics_listen: str = "", refused: Counter[str] | None = None,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; reports the bound TCP port through task_status.

    ``unix_path``: also serve every route on a Unix socket (mode 0600). ``metrics_listen`` ('HOST:PORT'):
    also serve /metrics alone there, token-guarded, for a scraper outside this host or container.
    ``refused`` counts requests the guards turned away, by reason.
    """
    refused = Counter() if refused is None else refused
    tcp = _bind_tcp(host, port, f"control_port = {port}")
    bound_port = tcp.getsockname()[1]
    apps = [(tcp, ControlApp(routes, token=token, hosts=loopback_hosts(bound_port), refused=refused))]
    try:
        if unix_path is not None:
            apps.append((_bind_unix(unix_path), ControlApp(routes, token=token, hosts=None, refused=refused)))
        if metrics_listen:
            m_host, m_port = parse_listen(metrics_listen)
            apps.append((_bind_tcp(m_host, m_port, f"metrics_listen = {metrics_listen!r}"),
                         ControlApp(routes, token=token, hosts=None, only=frozenset({"/metrics"}),
                                    page_paths=frozenset(), refused=refused)))
    except BaseException:
        for sock, _ in apps:
            sock.close()
        raise
    try:
        async with trio.open_nursery() as nursery:
            for sock, app in apps:
                await nursery.start(_serve_socket, sock, app)
            if metrics_listen:
                log.info("/metrics also on %s (token required)", metrics_listen)
            task_status.started(bound_port)
    finally:
        if unix_path is not None:
            with trio.CancelScope(shield=True):
                unix_path.unlink(missing_ok=True)


# -- the client (CLI, scripts, tests) --------------------------------------------------------------

class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        dir_fd = os.open(self.unix_path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(_short_unix_path(self.unix_path, dir_fd))
            except OSError:
                sock.close()
                raise
        finally:
            os.close(dir_fd)
        self.sock = sock


@dataclass(frozen=True, kw_only=True)
class ControlClient:
    """Blocking client: over TCP (``url``) or the node's Unix socket (``socket_path``), always with the token."""

    token: str
    url: str = ""
    socket_path: Path | None = None

    @property
    def where(self) -> str:
        return str(self.socket_path) if self.socket_path is not None else self.url

    def request(self, method: str, path: str, *, body: bytes | None = None, content_type: str = "application/json",
                timeout_s: float = 10.0) -> tuple[int, str, bytes]:
        if self.socket_path is not None:
            conn: http.client.HTTPConnection = _UnixConnection(self.socket_path, timeout_s)
            prefix = ""
        else:
            parts = urllib.parse.urlsplit(self.url)
            conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
            prefix = parts.path.rstrip("/")
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            conn.request(method, prefix + path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type", ""), resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ShoalError(f"cannot reach the node's control API at {self.where} ({exc}); "
                             f"is `shoal start` running?") from None
        finally:
            conn.close()

    def call(self, path: str, *, body: Any = None, timeout_s: float = 10.0) -> Any:
        """GET (or POST a JSON body) and decode the JSON answer; ShoalError with the node's message."""
        data = None if body is None else json.dumps(body).encode()
        status, _, raw = self.request("GET" if data is None else "POST", path, body=data, timeout_s=timeout_s)
        try:
            answer = json.loads(raw)
        except ValueError:
            raise ShoalError(f"the control API at {self.where} answered {status} with no JSON") from None
        if status >= 400:
            raise ShoalError(answer.get("error", f"HTTP {status}") if isinstance(answer, dict) else f"HTTP {status}")
        return answer

    def text(self, path: str, *, timeout_s: float = 10.0) -> str:
        status, _, raw = self.request("GET", path, timeout_s=timeout_s)
        if status >= 400:
            raise ShoalError(f"GET {path}: HTTP {status}: {raw[:200].decode(errors='replace')}")
        return raw.decode()


def call(url: str, *, token: str, body: Any = None, timeout_s: float = 10.0) -> Any:
    """One call over TCP: ``url`` is the control URL with the path."""
    parts = urllib.parse.urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return ControlClient(token=token, url=f"{parts.scheme}://{parts.netloc}").call(target, body=body,
                                                                                   timeout_s=timeout_s)


def client_for(data_dir: Path, url: str | None = None) -> ControlClient:
    """The CLI's client: the node's Unix socket when it is there (and no --url), else its TCP URL."""
    token = read_token(data_dir)
    if url:
        return ControlClient(token=token, url=url.rstrip("/"))
    sock = data_dir / SOCKET_FILE
    try:
        if stat.S_ISSOCK(os.stat(sock).st_mode):
            return ControlClient(token=token, socket_path=sock)
    except FileNotFoundError:
        pass
    from node.daemon import read_ready_file
    return ControlClient(token=token, url=read_ready_file(data_dir)["control_url"])
