"""A page from another origin, in headless Chromium, throws every kind of request at the control API: nothing changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from node.control import ControlClient
from node.daemon import run_node
from node.services import default_services
from tests.browser import chromium, serve_pages
from tests.node.conftest import fast_config

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-task.toml"
STATE_CHANGING = ("/shard/publish", "/shard/upload", "/shard/fetch", "/task/publish")

ATTACK_JS = r"""
const done = arguments[arguments.length - 1];
const [bases, bodies, routes] = [ARGS.bases, ARGS.bodies, ARGS.routes];
const results = [];
async function attempt(name, fn) {
  try { results.push({name, ok: true, read: String(await fn())}); }
  catch (e) { results.push({name, ok: false, read: "", err: String(e)}); }
}
const text = async (r) => r.type + ":" + r.status + ":" + (await r.text());
function xhr(url, type, body) {
  return new Promise((resolve, reject) => {
    const x = new XMLHttpRequest();
    x.open("POST", url); if (type) x.setRequestHeader("Content-Type", type);
    x.withCredentials = true;
    x.onload = () => resolve(x.status + ":" + x.responseText); x.onerror = () => reject(new Error("xhr error"));
    x.send(body);
  });
}
function submitForm(url, enctype, payload) {
  return new Promise((resolve) => {
    const frame = document.createElement("iframe");
    frame.name = "f" + Math.random().toString(36).slice(2);
    document.body.appendChild(frame);
    const form = document.createElement("form");
    form.method = "POST"; form.action = url; form.enctype = enctype; form.target = frame.name;
    const input = document.createElement("input");
    // The text/plain trick: name + "=" + value reads as JSON on the server.
    input.name = payload.slice(0, -2) + ', "pad": "'; input.value = '"}';
    form.appendChild(input); document.body.appendChild(form);
    frame.onload = () => { let seen = ""; try { seen = frame.contentDocument.body.innerText; } catch (e) { seen = ""; }
                           resolve("loaded:" + seen); };
    form.submit();
    setTimeout(() => resolve("timeout"), 1500);
  });
}
(async () => {
  for (const base of bases) {
    for (const route of routes) {
      const url = base + route, body = JSON.stringify(bodies[route]);
      await attempt(`${url} fetch no-cors text/plain`, async () => text(await fetch(url, {method: "POST", mode: "no-cors", credentials: "include", body})));
      await attempt(`${url} fetch no-cors json header`, async () => text(await fetch(url, {method: "POST", mode: "no-cors", headers: {"Content-Type": "application/json"}, body})));
      await attempt(`${url} fetch cors json`, async () => text(await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"}, body})));
      await attempt(`${url} fetch cors text/plain`, async () => text(await fetch(url, {method: "POST", headers: {"Content-Type": "text/plain"}, body})));
      await attempt(`${url} fetch bearer guess`, async () => text(await fetch(url, {method: "POST", headers: {"Content-Type": "application/json", "Authorization": "Bearer guess"}, body})));
      await attempt(`${url} fetch blob json`, async () => text(await fetch(url, {method: "POST", mode: "no-cors", body: new Blob([body], {type: "application/json"})})));
      await attempt(`${url} xhr text/plain`, () => xhr(url, "text/plain", body));
      await attempt(`${url} xhr json`, () => xhr(url, "application/json", body));
      await attempt(`${url} beacon text/plain`, async () => navigator.sendBeacon(url, new Blob([body], {type: "text/plain"})) ? "queued" : "refused");
      await attempt(`${url} beacon json`, async () => navigator.sendBeacon(url, new Blob([body], {type: "application/json"})) ? "queued" : "refused");
      for (const enctype of ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]) {
        await attempt(`${url} form ${enctype}`, () => submitForm(url, enctype, body));
      }
    }
    for (const path of ["/status", "/peers", "/metrics", "/", "/tasks"]) {
      await attempt(`${base}${path} fetch read`, async () => text(await fetch(base + path, {credentials: "include"})));
    }
  }
  await new Promise((r) => setTimeout(r, 1000));  // let beacons leave
  done(results);
})();
"""


def bodies(data_dir: Path, stolen: Path) -> dict:
    return {"/shard/publish": {"path": str(data_dir / "node.key")},
            "/shard/upload": {"name": "node.key", "bytes": 64},
            "/shard/fetch": {"manifest_id": "ab" * 32, "out": str(stolen)},
            "/task/publish": {"toml": EXAMPLE.read_text()}}


def run_attack(drv, page_url: str, args: dict) -> list[dict]:
    drv.get(page_url)
    return drv.execute_async_script(ATTACK_JS.replace("ARGS", json.dumps(args)))


def assert_read_nothing(results: list[dict], secrets: list[str]) -> None:
    assert results
    for r in results:
        for secret in secrets:
            assert secret not in r["read"], r
        # An opaque answer (no-cors) reads as "opaque:0:"; a readable one would show the node's JSON.
        assert '"peer_id"' not in r["read"] and "shoal_" not in r["read"], r


async def test_another_origin_cannot_read_or_change_anything(tmp_path):
    config = fast_config(tmp_path / "node", mdns=False, publish_dir=str(tmp_path))
    stolen = tmp_path / "stolen.bin"
    async with trio.open_nursery() as nursery:
        node = await nursery.start(lambda task_status: run_node(config, services=default_services(),
                                                                task_status=task_status))
        port = int(node.control_url.rsplit(":", 1)[1])
        args = {"bases": [f"http://127.0.0.1:{port}", f"http://localhost:{port}"],
                "bodies": bodies(config.data_dir, stolen), "routes": list(STATE_CHANGING)}

        def browse() -> tuple[list[dict], list[dict]]:
            with serve_pages({"/attack.html": lambda: b"<!doctype html><title>a page</title><body></body>"}) as page_port, \
                    chromium(tmp_path / "profile",
                             ("--host-resolver-rules=MAP rebind.test 127.0.0.1",)) as drv:
                cross = run_attack(drv, f"http://127.0.0.1:{page_port}/attack.html", args)
                # DNS rebinding: the attacker's name now resolves to loopback, so its script runs in the
                # node's own origin (same scheme, name and port): no CORS stands in the way, the Host header does.
                drv.get(f"http://rebind.test:{port}/")
                rebound = drv.execute_async_script(ATTACK_JS.replace("ARGS", json.dumps(
                    {**args, "bases": [f"http://rebind.test:{port}"]})))
                return cross, rebound

        cross, rebound = await trio.to_thread.run_sync(browse)
        secrets = [node.control_token, (config.data_dir / "node.key").read_bytes().hex()[:16]]
        assert_read_nothing(cross, secrets)
        assert_read_nothing(rebound, secrets)
        assert all("Host header must name this node" in r["read"] or not r["ok"] or r["read"].startswith("opaque")
                   or r["read"] in ("queued", "refused") or r["read"].startswith("loaded:")
                   for r in rebound), rebound
        # Nothing changed: no manifest, no upload, no task, no fetch output.
        assert node.shardcast.store.manifest_ids() == []
        assert list((config.data_dir / "uploads").iterdir()) == []
        assert node.tasks.tasks == {}
        assert not stolen.exists()
        # The requests did arrive, and were turned away by the guards (so this test can fail).
        refused = dict(node.control_refused)
        assert refused.get("origin", 0) >= 20 and refused.get("host", 0) >= 10, refused
        client = ControlClient(token=node.control_token, url=node.control_url)
        status = await trio.to_thread.run_sync(client.call, "/status")
        assert status["peer_id"] == node.keypair.peer_id
        nursery.cancel_scope.cancel()
