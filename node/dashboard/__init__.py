"""The dashboard: one page (assets shipped in the package, inlined, hash-pinned by CSP) fed by server-sent events."""

from __future__ import annotations

import base64
import hashlib
import json
from functools import lru_cache
from importlib import resources
from typing import AsyncIterator

import trio

from node.control import Request, Response
from node.metrics import task_summaries

PUSH_INTERVAL_S = 1.0
"""How often a changed snapshot is pushed; an unchanged one is not sent (a comment keeps the stream open)."""
KEEPALIVE_S = 15.0
MAX_ROUNDS_SHOWN = 200


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@lru_cache(maxsize=1)
def page() -> tuple[bytes, str]:
    """(HTML, Content-Security-Policy): the script and style inline, each allowed by its hash and nothing else."""
    script, style = _asset("app.js"), _asset("app.css")
    html = _asset("index.html").replace("/*STYLE*/", style).replace("/*SCRIPT*/", script)
    csp = (f"default-src 'none'; script-src {_sha256(script)}; style-src {_sha256(style)}; connect-src 'self'; "
           "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode(), csp


def snapshot(node) -> dict:
    """Everything the page shows, from the node's public status."""
    status = node.status()
    tasks = []
    for t in task_summaries(node):
        t = {k: v for k, v in t.items() if k != "dissents"}
        t["agreement"] = t.get("agreement", [])[-MAX_ROUNDS_SHOWN:]
        t["eval_losses"] = t.get("eval_losses", [])[-MAX_ROUNDS_SHOWN:]
        tasks.append(t)
    status.pop("task", None)
    return {"node": status, "peers": node.peers(), "tasks": tasks}


def routes(node) -> dict:
    async def index(request: Request) -> Response:
        html, csp = page()
        return Response(200, html, "text/html; charset=utf-8", headers=(("Content-Security-Policy", csp),))

    async def state(request: Request) -> Response:
        return Response.json(snapshot(node))

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[bytes]:
            last, quiet_s = "", 0.0
            while True:
                text = json.dumps(snapshot(node), default=str, separators=(",", ":"))
                if text != last:
                    last, quiet_s = text, 0.0
                    yield f"event: snapshot\ndata: {text}\n\n".encode()
                elif quiet_s >= KEEPALIVE_S:
                    quiet_s = 0.0
                    yield b": keep-alive\n\n"
                await trio.sleep(PUSH_INTERVAL_S)
                quiet_s += PUSH_INTERVAL_S
        return Response(200, content_type="text/event-stream", stream=stream)

    return {"/": index, "/dashboard.json": state, "/events": events}
