"""Reachability from dial-backs on fresh connections, and the verdict they add up to (real libp2p hosts on loopback)."""

import pytest
import trio

from p2p import autonat
from p2p.autonat import Answer, Verdict
from p2p_harness import Swarm, connect, make_config, wait_until

pytestmark = pytest.mark.timeout(60)


def answer(server: str, ok: bool, ip: str = "203.0.113.7") -> Answer:
    return Answer(server=server, observed_ip=ip, reachable_ports=(4001,) if ok else (), asked_ports=(4001,))


def test_no_answers_is_unknown():
    assert Verdict().status()[0] == "unknown"


def test_one_peer_is_enough_when_it_is_the_only_one():
    v = Verdict()
    v.add(answer("a", ok=False))
    status, why = v.status()
    assert status == "private" and "could not dial back 203.0.113.7 port 4001" in why


def test_two_agreeing_answers_decide_and_a_split_waits():
    v = Verdict()
    v.add(answer("a", ok=True))
    v.add(answer("b", ok=False))
    assert v.status()[0] == "unknown"
    v.add(answer("c", ok=True))
    assert v.status()[0] == "public"
    assert v.public_endpoints() == [("203.0.113.7", 4001)]


def test_a_later_answer_from_the_same_peer_replaces_its_earlier_one():
    v = Verdict()
    v.add(answer("a", ok=True))
    v.add(answer("a", ok=False))
    assert v.status()[0] == "private"


async def test_loopback_hosts_learn_they_are_public_and_serve_as_relays():
    swarm = Swarm("libp2p")
    async with swarm.hosts(2, make_config(nat=True)) as (a, b):
        await connect(a, b)
        await wait_until(lambda: a.reachability().status == "public" and b.reachability().status == "public",
                         timeout_s=20)
        r = a.reachability()
        assert r.observed_ips == ("127.0.0.1",) and r.relaying and r.dial_backs_ok == 1
        assert r.public_addrs[0].startswith("/ip4/127.0.0.1/tcp/") and r.public_addrs[0].endswith(a.peer_id)
        assert a.is_direct(b.peer_id)


async def test_dial_back_uses_a_fresh_connection_and_checks_the_key():
    """The asker is connected already; a port with no listener, or another host's port, must not count."""
    swarm = Swarm("libp2p")
    async with swarm.hosts(3, make_config(nat=True)) as (asker, server, stranger):
        await connect(asker, server)
        asker_port = int(asker.listen_addrs()[0].split("/tcp/")[1].split("/")[0])
        stranger_port = int(stranger.listen_addrs()[0].split("/tcp/")[1].split("/")[0])
        with trio.socket.socket() as probe:  # a port that nothing listens on
            await probe.bind(("127.0.0.1", 0))
            dead_port = probe.getsockname()[1]
        from libp2p.peer.id import ID
        got = await autonat.ask(asker._host, ID.from_base58(server.peer_id), [asker_port, dead_port, stranger_port])
        assert got is not None and got.observed_ip == "127.0.0.1"
        assert got.reachable_ports == (asker_port,)


async def test_fake_hosts_report_public_and_direct():
    swarm = Swarm("fake")
    async with swarm.hosts(2) as (a, b):
        await connect(a, b)
        assert a.reachability().status == "public" and a.is_direct(b.peer_id)


async def test_bulk_protocols_never_cross_a_relay_and_relayed_bytes_are_counted():
    """Loopback hosts: B reaches A through relay R; a bulk stream is refused until DCUtR finds a direct path."""
    from protocol.errors import PeerUnreachable

    bulk, control = "/test/bulk/1", "/test/control/1"
    swarm = Swarm("libp2p")
    config = make_config(nat=True, direct_only_protocols=(bulk,))
    async with swarm.hosts(3, config) as (r, a, b):
        async def echo(stream):
            await stream.write(await stream.read(100))
            await stream.close()
        for host in (a, b):
            host.set_stream_handler(bulk, echo)
            host.set_stream_handler(control, echo)
        await connect(a, r)
        await connect(b, r)
        await wait_until(lambda: r.reachability().relaying, timeout_s=20)
        await a.nat._keep_relays()  # as a private node would; on loopback everyone is public
        relay_addr = a.reachability().relay_addrs[0]
        assert "/p2p-circuit/p2p/" + a.peer_id in relay_addr
        # Hold DCUtR back (its attempt budget looks spent) until the relayed-only checks are done.
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS
        for host, other in ((a, b), (b, a)):
            host.nat.dcutr._hole_punch_attempts[ID.from_base58(other.peer_id)] = MAX_HOLE_PUNCH_ATTEMPTS
        assert await b.connect(relay_addr) == a.peer_id
        assert not b.is_direct(a.peer_id)
        stream = await b.open_stream(a.peer_id, control)  # small control streams may use the relay
        await stream.write(b"ping")
        assert await stream.read(100) == b"ping"
        await stream.close()
        with pytest.raises(PeerUnreachable, match="never runs over a relay"):
            await b.open_stream(a.peer_id, bulk)
        assert b.statistics().relayed_streams_refused == 1
        assert b.statistics().relayed_bytes_by_protocol[control] == 4 + 4
        for host in (a, b):
            host.nat.dcutr._hole_punch_attempts.clear()
        await wait_until(lambda: b.is_direct(a.peer_id), timeout_s=30)  # DCUtR upgrades the connection
        stream = await b.open_stream(a.peer_id, bulk)
        await stream.write(b"x" * 50)
        assert await stream.read(100) == b"x" * 50
        await stream.close()
        assert bulk not in b.statistics().relayed_bytes_by_protocol


async def test_a_mapped_port_is_dialed_back_before_it_counts():
    """The router (a NAT-PMP stand-in on loopback UDP) grants a port nothing forwards: peers' dial-backs
    fail there, so only the listen port, which they did reach, is announced as public."""
    from test_portmap import Router

    router = Router(grant_port=40001)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(router.serve)
        swarm = Swarm("libp2p")
        config = make_config(nat=True, port_mapping=True, port_mapping_gateway=f"127.0.0.1:{port}")
        async with swarm.hosts(2, config) as (a, b):
            await connect(a, b)
            await wait_until(lambda: a.reachability().port_mapping.get("status") == "mapped"
                             and a.reachability().status == "public"
                             and 40001 in next(iter(a.nat.verdict.answers.values())).asked_ports, timeout_s=20)
            r = a.reachability()
            assert r.port_mapping["external_port"] == 40001 and r.port_mapping["internal_port"] != 40001
            assert r.public_addrs == (f"/ip4/127.0.0.1/tcp/{r.port_mapping['internal_port']}/p2p/{a.peer_id}",)
        # The hosts stopped: each deleted its mapping.
        assert [m[3] for m in router.maps()].count(0) == 2
        nursery.cancel_scope.cancel()
