"""The control API of a running node: JSON status and peers, Prometheus metrics, clean errors."""

import json
import urllib.error
import urllib.request

import pytest
import trio

from node.control import call
from protocol.errors import ShoalError
from tests.node.conftest import fast_config, start_node, wait_until


def get(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read().decode()


CALM = dict(heartbeat_interval_s=0.5, suspect_after_s=5.0, dead_after_s=10.0)


async def test_status_peers_and_metrics(network, tmp_path):
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, fast_config(tmp_path / "a", **CALM), network.open_host)
        b, _ = await start_node(nursery, fast_config(tmp_path / "b", bootstrap=a.host.listen_addrs(), **CALM),
                                network.open_host)
        await wait_until(lambda: a.membership.table.alive() == [b.keypair.peer_id])
        status = await trio.to_thread.run_sync(call, a.control_url + "/status")
        assert status["peer_id"] == a.keypair.peer_id and status["peers"]["alive"] == 1
        peers = await trio.to_thread.run_sync(call, a.control_url + "/peers")
        assert [p["peer_id"] for p in peers["peers"]] == [b.keypair.peer_id]
        assert peers["peers"][0]["state"] == "alive"
        code, ctype, text = await trio.to_thread.run_sync(get, a.control_url + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert 'shoal_peers{state="alive"} 1.0' in text
        assert "shoal_messages_in_total" in text and "shoal_bytes_sent_total" in text
        with pytest.raises(ShoalError, match="no such endpoint"):
            await trio.to_thread.run_sync(call, a.control_url + "/nope")
        nursery.cancel_scope.cancel()


async def test_garbage_request_gets_an_error_and_the_server_keeps_serving(network, tmp_path):
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, fast_config(tmp_path / "a"), network.open_host)
        port = int(a.control_url.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"\x00\x01garbage\r\n\r\n")
        reply = await stream.receive_some(4096)
        assert reply.startswith(b"HTTP/1.1 400")
        await stream.aclose()
        status = await trio.to_thread.run_sync(call, a.control_url + "/status")
        assert json.dumps(status)
        nursery.cancel_scope.cancel()
