"""The NAT-PMP client against a router stand-in on loopback UDP (the netlab test runs it against miniupnpd)."""

import socket
import struct

import pytest
import trio

from p2p import portmap
from protocol import natpmp


class Router:
    """Answers NAT-PMP as RFC 6886 says; knobs make it refuse, stay silent, grant another port or reboot."""

    def __init__(self, *, grant_port: int | None = None, result: int = 0, silent: bool = False,
                 stray_first: bool = False):
        self.grant_port, self.result, self.silent, self.stray_first = grant_port, result, silent, stray_first
        self.requests: list[tuple[int, ...]] = []
        self.started = trio.current_time()
        self.port = 0

    def epoch(self) -> int:
        return 1000 + int(trio.current_time() - self.started)

    def reboot(self) -> None:
        self.started = trio.current_time() + 1000  # its epoch counts from 0 again

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            await sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            task_status.started(self.port)
            while True:
                data, addr = await sock.recvfrom(64)
                op = data[1]
                if op == natpmp.OP_EXTERNAL_ADDRESS:
                    self.requests.append((op,))
                    reply = struct.pack("!BBHI", 0, 128, self.result, self.epoch()) + bytes([203, 0, 113, 9])
                else:
                    _, _, _, internal, external, lifetime = struct.unpack("!BBHHHI", data)
                    self.requests.append((op, internal, external, lifetime))
                    granted = 0 if lifetime == 0 else (self.grant_port or external or internal)
                    reply = struct.pack("!BBHIHHI", 0, 128 + op, self.result, self.epoch(), internal, granted,
                                        lifetime)
                if self.silent:
                    continue
                if self.stray_first:
                    await sock.sendto(b"\x00\x81garbage", addr)
                await sock.sendto(reply, addr)

    def maps(self) -> list[tuple[int, ...]]:
        return [r for r in self.requests if r[0] == natpmp.OP_MAP_TCP]


def closed_udp_port() -> int:
    """A loopback UDP port nothing listens on: a datagram there is answered with ICMP port-unreachable."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def run_mapper(nursery, router: Router, **kwargs) -> portmap.PortMapper:
    port = router.port or await nursery.start(router.serve)
    changes: list[str] = []
    # UPnP, tried when NAT-PMP fails, finds nothing here (it is tested against miniupnpd in netlab).
    mapper = portmap.PortMapper(4001, gateway="127.0.0.1", port=port, ssdp_port=closed_udp_port(),
                                on_change=lambda state: changes.append(state.status), **kwargs)
    mapper.changes = changes
    nursery.start_soon(mapper.run)
    return mapper


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.01)


async def test_the_listen_port_is_mapped_and_the_granted_port_is_what_counts():
    router = Router(grant_port=40001)
    async with trio.open_nursery() as outer:
        await outer.start(router.serve)
        async with trio.open_nursery() as nursery:
            mapper = await run_mapper(nursery, router)
            await wait_until(lambda: mapper.state.status == "mapped")
            state = mapper.state
            assert (state.external_address, state.external_port, state.internal_port, state.lifetime_s) == \
                ("203.0.113.9", 40001, 4001, portmap.LIFETIME_S)
            assert state.to_dict()["summary"] == \
                "NAT-PMP on 127.0.0.1: 203.0.113.9:40001 -> port 4001 (renewed every 1800 s)"
            assert state.protocol == "NAT-PMP"
            # We asked for our own port; the router's grant is what we use.
            assert router.maps() == [(natpmp.OP_MAP_TCP, 4001, 4001, portmap.LIFETIME_S)]
            assert mapper.changes == ["mapped"]
            nursery.cancel_scope.cancel()
        # Stopping deletes the mapping (lifetime 0) rather than leaving it open for an hour.
        assert router.maps()[-1] == (natpmp.OP_MAP_TCP, 4001, 0, 0)
        outer.cancel_scope.cancel()


async def test_a_mapping_is_renewed_at_half_its_lifetime_keeping_its_port():
    router = Router(grant_port=40001)
    async with trio.open_nursery() as nursery:
        mapper = await run_mapper(nursery, router, lifetime_s=2)
        await wait_until(lambda: len(router.maps()) >= 3)
        nursery.cancel_scope.cancel()
    renewals = router.maps()[1:3]
    assert renewals == [(natpmp.OP_MAP_TCP, 4001, 40001, 2)] * 2, router.maps()  # asks for the port it holds
    assert mapper.changes == ["mapped"]  # a renewal that changes nothing is not news


async def test_a_router_that_lost_its_mappings_is_asked_again_at_the_next_check():
    router = Router()
    async with trio.open_nursery() as nursery:
        mapper = await run_mapper(nursery, router, check_s=0.2)
        await wait_until(lambda: mapper.state.status == "mapped")
        await trio.sleep(0.5)
        assert len(router.maps()) == 1  # checks ask the address only, while the epoch advances
        router.reboot()
        await wait_until(lambda: len(router.maps()) == 2)
        nursery.cancel_scope.cancel()


async def test_a_refusal_is_reported_with_the_routers_reason():
    router = Router(result=2)
    async with trio.open_nursery() as nursery:
        mapper = await run_mapper(nursery, router)
        await wait_until(lambda: mapper.state.status == "unavailable")
        assert "NAT-PMP: the router refused: not authorized" in mapper.state.reason, mapper.state
        assert router.maps() == []  # the address request was refused already
        nursery.cancel_scope.cancel()


async def test_a_gateway_without_nat_pmp_or_upnp_is_reported_with_each_protocols_reason():
    mapper = portmap.PortMapper(4001, gateway="127.0.0.1", port=closed_udp_port(), ssdp_port=closed_udp_port())
    with trio.fail_after(8):
        await mapper._step()
    assert mapper.state.status == "unavailable"
    # NAT-PMP's port-unreachable ends its wait at once; SSDP answers come from another port, so its
    # socket is not connected and it waits out its two tries.
    assert "NAT-PMP: 127.0.0.1 answers no NAT-PMP" in mapper.state.reason
    assert "UPnP IGD: no UPnP (SSDP) answer from 127.0.0.1 within 4.5 s" in mapper.state.reason


async def test_a_silent_gateway_times_out_on_the_rfcs_schedule():
    router = Router(silent=True)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(router.serve)
        start = trio.current_time()
        with pytest.raises(portmap.NoAnswer, match="within 0.75 s"):
            await portmap.exchange("127.0.0.1", natpmp.external_address_request(), natpmp.parse_external_address,
                                   port=port, tries=2)
        assert 0.7 < trio.current_time() - start < 2.0
        assert len(router.requests) == 2  # sent, then resent after 250 ms
        nursery.cancel_scope.cancel()


async def test_a_stray_datagram_is_ignored_not_taken_for_the_answer():
    router = Router(stray_first=True)
    async with trio.open_nursery() as nursery:
        mapper = await run_mapper(nursery, router)
        await wait_until(lambda: mapper.state.status == "mapped")
        assert mapper.state.external_address == "203.0.113.9"
        nursery.cancel_scope.cancel()


def test_the_default_gateway_comes_from_the_kernels_routing_table(tmp_path):
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t0000D60A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
        "eth0\t00000000\t01D6D60A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    assert portmap.default_gateway(table) == "10.214.214.1"
    table.write_text("Iface\tDestination\tGateway\tFlags\neth0\t0000D60A\t00000000\t0001\n")
    assert portmap.default_gateway(table) is None
    assert portmap.default_gateway(tmp_path / "missing") is None


def test_requests_to_the_router_follow_no_redirect_and_no_proxy(monkeypatch):
    import http.server
    import threading

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            if self.path == "/rootDesc.xml":  # sends us elsewhere (here: to its own /elsewhere)
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/elsewhere")
                self.end_headers()
            else:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"followed")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # would fail the request if it were used
    try:
        status, _ = portmap._http(f"http://127.0.0.1:{server.server_port}/rootDesc.xml")
    finally:
        server.shutdown()
        server.server_close()
    assert status == 302 and hits == ["/rootDesc.xml"]


async def test_a_upnp_port_taken_by_another_host_is_mapped_elsewhere():
    """UPnP routers answer 718 when the external port is mapped to another host (a second node in the home)."""
    from protocol import upnp

    calls: list[dict] = []

    async def call(action, **args):
        calls.append({"action": action, **args})
        if args["NewExternalPort"] == 4001:
            raise upnp.UpnpFault(718, "ConflictInMappingEntry")
        return {}

    router = portmap.UpnpRouter("192.168.1.1")
    router.local_address, router._call = "192.168.1.20", call
    assert await router.map(4001, 4001, 3600) == (portmap.alternate_ports(4001)[0], 3600)
    assert [c["NewExternalPort"] for c in calls] == [4001, portmap.alternate_ports(4001)[0]]
    assert all(c["NewInternalPort"] == 4001 and c["NewInternalClient"] == "192.168.1.20" for c in calls)

    async def always_taken(action, **args):
        raise upnp.UpnpFault(718, "ConflictInMappingEntry")

    router._call = always_taken
    with pytest.raises(upnp.UpnpFault, match="718"):
        await router.map(4001, 4001, 3600)

    async def permanent_only(action, **args):
        if args["NewLeaseDuration"]:
            raise upnp.UpnpFault(725, "OnlyPermanentLeasesSupported")
        return {}

    router._call = permanent_only
    assert await router.map(4001, 4001, 3600) == (4001, 0)
