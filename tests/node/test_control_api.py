"""The control API of a running node: token, Host and content-type guards, the Unix socket, uploads, clean errors."""

import http.client
import json
import os
import stat

import pytest
import trio
from typer.testing import CliRunner

from node.cli import app as cli_app
from node.control import SOCKET_FILE, TOKEN_FILE, ControlClient, read_token
from node.daemon import run_node
from node.shard_api import start_shardcast
from protocol.errors import ShoalError
from tests.node.conftest import fast_config, start_node, wait_until

CALM = dict(heartbeat_interval_s=0.5, suspect_after_s=5.0, dead_after_s=10.0)


def raw(port: int, method: str, path: str, headers: dict, body: bytes | None = None):
    """One request with exactly these headers (http.client adds Host only when it is not given)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def port_of(node) -> int:
    return int(node.control_url.rsplit(":", 1)[1])


async def start_with_shardcast(nursery, config):
    return await nursery.start(lambda task_status: run_node(config, services=[start_shardcast],
                                                            task_status=task_status))


async def test_status_peers_and_metrics_with_the_token(network, tmp_path):
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, fast_config(tmp_path / "a", mdns=False, **CALM))
        b, _ = await start_node(nursery, fast_config(tmp_path / "b", mdns=False, bootstrap=a.host.listen_addrs(),
                                                     **CALM))
        await wait_until(lambda: a.membership.table.alive() == [b.keypair.peer_id])
        client = ControlClient(token=a.control_token, url=a.control_url)
        status = await trio.to_thread.run_sync(client.call, "/status")
        assert status["peer_id"] == a.keypair.peer_id and status["peers"]["alive"] == 1
        # On the in-memory network the wire is the gossip and the streams; the announce topic is among it.
        assert status["wire_bytes"]["sent"] >= status["bytes"]["sent"] and status["wire_bytes"]["received"] > 0
        assert status["gossip_bytes_sent"].get("shoal/announce/1", 0) > 0, status["gossip_bytes_sent"]
        peers = await trio.to_thread.run_sync(client.call, "/peers")
        assert [p["peer_id"] for p in peers["peers"]] == [b.keypair.peer_id]
        assert peers["peers"][0]["path"] == "direct" and peers["peers"][0]["behind_nat"] is False
        text = await trio.to_thread.run_sync(client.text, "/metrics")
        assert 'shoal_peers{state="alive"} 1.0' in text
        with pytest.raises(ShoalError, match="no such endpoint"):
            await trio.to_thread.run_sync(client.call, "/nope")
        nursery.cancel_scope.cancel()


async def test_token_file_and_socket_are_private_and_the_token_survives_a_restart(network, tmp_path):
    config = fast_config(tmp_path / "a")
    async with trio.open_nursery() as nursery:
        a, scope = await start_node(nursery, config, network.open_host)
        token_path, sock_path = config.data_dir / TOKEN_FILE, config.data_dir / SOCKET_FILE
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
        assert stat.S_ISSOCK(sock_path.stat().st_mode) and stat.S_IMODE(sock_path.stat().st_mode) == 0o600
        assert read_token(config.data_dir) == a.control_token
        scope.cancel()
    assert not sock_path.exists()
    async with trio.open_nursery() as nursery:
        again, _ = await start_node(nursery, config, network.open_host)
        assert again.control_token == a.control_token
        nursery.cancel_scope.cancel()


async def test_a_loose_token_file_is_replaced(network, tmp_path):
    config = fast_config(tmp_path / "a")
    config.data_dir.mkdir(parents=True)
    (config.data_dir / TOKEN_FILE).write_text("x" * 43)
    os.chmod(config.data_dir / TOKEN_FILE, 0o644)
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, config, network.open_host)
        assert a.control_token != "x" * 43
        assert stat.S_IMODE((config.data_dir / TOKEN_FILE).stat().st_mode) == 0o600
        nursery.cancel_scope.cancel()


async def test_requests_without_the_token_a_loopback_host_or_json_are_refused(network, tmp_path):
    async with trio.open_nursery() as nursery:
        a = await start_with_shardcast(nursery, fast_config(tmp_path / "a", mdns=False))
        port, token = port_of(a), a.control_token
        auth = {"Authorization": f"Bearer {token}"}
        here = {"Host": f"127.0.0.1:{port}"}

        def check():
            out = {}
            out["no token"] = raw(port, "GET", "/status", here)
            out["wrong token"] = raw(port, "GET", "/status", {**here, "Authorization": "Bearer " + "y" * 43})
            out["token in query"] = raw(port, "GET", f"/status?token={token}", here)
            out["rebinding host"] = raw(port, "GET", "/status", {"Host": f"evil.example:{port}", **auth})
            out["other port host"] = raw(port, "GET", "/status", {"Host": f"127.0.0.1:{port + 1}", **auth})
            out["other origin"] = raw(port, "POST", "/task/publish",
                                      {**here, **auth, "Origin": "http://127.0.0.1:8000",
                                       "Content-Type": "application/json"}, b"{}")
            out["text/plain"] = raw(port, "POST", "/shard/publish", {**here, **auth, "Content-Type": "text/plain"},
                                    json.dumps({"path": str(a.config.data_dir / "node.key")}).encode())
            out["form"] = raw(port, "POST", "/shard/publish",
                              {**here, **auth, "Content-Type": "application/x-www-form-urlencoded"}, b"path=x")
            out["no type"] = raw(port, "POST", "/task/publish", {**here, **auth}, b"{}")
            out["preflight"] = raw(port, "OPTIONS", "/shard/publish",
                                   {**here, "Origin": "http://127.0.0.1:8000",
                                    "Access-Control-Request-Method": "POST"})
            out["options"] = raw(port, "OPTIONS", "/shard/publish", {**here, **auth})
            out["ok"] = raw(port, "GET", "/status", {"Host": f"localhost:{port}", **auth})
            return out

        out = await trio.to_thread.run_sync(check)
        codes = {k: v[0] for k, v in out.items()}
        assert codes == {"no token": 401, "wrong token": 401, "token in query": 401, "rebinding host": 403,
                         "other port host": 403, "other origin": 403, "text/plain": 415, "form": 415,
                         "no type": 415, "preflight": 403, "options": 405, "ok": 200}, codes
        assert a.control_refused == {"token": 3, "host": 2, "origin": 2, "content_type": 3, "options": 1}
        for name, (_, headers, _) in out.items():
            assert not any(h.lower().startswith("access-control-") for h in headers), name
        assert a.shardcast.store.manifest_ids() == []
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(f"GET /status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: evil.example\r\n"
                              f"Authorization: Bearer {token}\r\nConnection: close\r\n\r\n".encode())
        reply = await stream.receive_some(4096)
        assert reply.startswith(b"HTTP/1.1 400"), reply
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_the_cli_uses_the_unix_socket(network, tmp_path):
    config = fast_config(tmp_path / "a")
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, config, network.open_host)
        out = await trio.to_thread.run_sync(lambda: CliRunner().invoke(
            cli_app, ["status", "--json", "--data-dir", str(config.data_dir)]))
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["peer_id"] == a.keypair.peer_id
        (config.data_dir / TOKEN_FILE).write_text("z" * 43 + "\n")
        out = await trio.to_thread.run_sync(lambda: CliRunner().invoke(
            cli_app, ["status", "--data-dir", str(config.data_dir)]))
        assert out.exit_code == 2 and "wrong control token" in out.output and "Traceback" not in out.output
        nursery.cancel_scope.cancel()


async def test_metrics_listen_serves_only_metrics_with_the_token(network, tmp_path):
    probe = trio.socket.socket()
    await probe.bind(("127.0.0.1", 0))
    free_port = probe.getsockname()[1]
    probe.close()
    config = fast_config(tmp_path / "a", metrics_listen=f"127.0.0.1:{free_port}")
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, config, network.open_host)
        # A scraper names the address it was given, not loopback: any Host is fine there, the token is not.
        auth = {"Host": f"node-a.internal:{free_port}", "Authorization": f"Bearer {a.control_token}"}
        ok = await trio.to_thread.run_sync(raw, free_port, "GET", "/metrics", auth)
        assert ok[0] == 200 and b"shoal_connected_peers" in ok[2]
        status = await trio.to_thread.run_sync(raw, free_port, "GET", "/status", auth)
        assert status[0] == 404
        anon = await trio.to_thread.run_sync(raw, free_port, "GET", "/metrics", {"Host": "x"})
        assert anon[0] == 401
        nursery.cancel_scope.cancel()


async def test_garbage_request_gets_an_error_and_the_server_keeps_serving(network, tmp_path):
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, fast_config(tmp_path / "a"), network.open_host)
        stream = await trio.open_tcp_stream("127.0.0.1", port_of(a))
        await stream.send_all(b"\x00\x01garbage\r\n\r\n")
        reply = await stream.receive_some(4096)
        assert reply.startswith(b"HTTP/1.1 400")
        await stream.aclose()
        client = ControlClient(token=a.control_token, url=a.control_url)
        status = await trio.to_thread.run_sync(client.call, "/status")
        assert status["peer_id"] == a.keypair.peer_id
        nursery.cancel_scope.cancel()
