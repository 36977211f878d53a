"""Home nodes behind netlab NAT routers: they learn they are private, get relayed, punch through and train."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import netlab_nat, netlab_portmap
from scripts.local_swarm import ROOT, Swarm, stop
from scripts.swarm_task import TaskRun, spec_fields, use_local_corpus
from tests.integration.test_swarm_processes import FAST_ENV

pytestmark = [pytest.mark.netlab, pytest.mark.slow]

PROBE = """import socket, sys
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "serve":
    s = socket.create_server((host, port), reuse_port=True); s.settimeout(8); print("ready", flush=True)
    try:
        while True:
            c, a = s.accept(); c.sendall(f"{a[0]}:{a[1]}".encode()); c.close()
    except OSError:
        pass
else:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); s.settimeout(2)
    if len(sys.argv) > 4:
        s.bind(("0.0.0.0", int(sys.argv[4])))
    try:
        s.connect((host, port))
    except OSError:
        print("unreachable")  # a dropped SYN: the connect times out
    else:
        s.settimeout(20)  # the server only has to answer; on a loaded machine that can take a while
        print(s.recv(64).decode())
"""
SHARD_PROTOCOL_PREFIX = "/shoal/shard/"
"""Every version of the shard protocol: bulk data that never crosses a relay."""


@pytest.fixture
def nat_lab_factory(netlab_session):
    reason = netlab_nat.nat_unavailable_reason()
    if reason:
        pytest.skip(reason)
    labs = []

    def make(num_public: int, kinds: list[str]) -> netlab_nat.NatLab:
        labs.append(netlab_nat.NatLab.create_homes(num_public, kinds))
        return labs[-1]

    try:
        yield make
    finally:
        for lab in labs:
            lab.destroy()


def probe(lab, host: str, *args: str) -> str:
    return lab.run(host, [sys.executable, "-c", PROBE, *args], timeout_s=60).stdout.strip()


def serve(lab, host: str, port: int) -> subprocess.Popen:
    proc = lab.exec(host, [sys.executable, "-c", PROBE, "serve", "0.0.0.0", str(port)], stdout=subprocess.PIPE,
                    text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.timeout(120)
def test_each_nat_kind_maps_and_filters_as_named(nat_lab_factory):
    lab = nat_lab_factory(2, ["full_cone", "port_restricted", "symmetric"])
    servers = [serve(lab, h.name, 5000) for h in lab.hosts[:2]]
    try:
        for home in lab.homes:
            private, router_ip = home["host"], home["public_address"]
            inside = serve(lab, private, 4001)
            try:
                assert probe(lab, "h1", "dial", router_ip, "4001") == "unreachable"  # nothing mapped yet
                seen = {probe(lab, private, "dial", lab.hosts[i].address, "5000", "4001") for i in (0, 1)}
                ports = {s.rsplit(":", 1)[1] for s in seen}
                assert {s.rsplit(":", 1)[0] for s in seen} == {router_ip}
                # Endpoint-independent mapping keeps the inside port for every destination; symmetric does not.
                assert (ports == {"4001"}) == (home["kind"] != "symmetric"), (home, seen)
                inbound = probe(lab, "h1", "dial", router_ip, "4001")
                assert (inbound != "unreachable") == (home["kind"] == "full_cone"), (home, inbound)
            finally:
                stop([inside], grace_s=1.0)
    finally:
        stop(servers, grace_s=1.0)


def reach(node) -> dict:
    return node.status.get("reachability") or {}


def wait_for(predicate, timeout_s: float, what: str, swarm: Swarm) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}; "
                                 f"reachability: {[reach(n) for n in swarm.nodes]}; "
                                 f"tasks: {[(n.status.get('task') or {}).get('phase') for n in swarm.nodes]}")
        swarm.update()
        time.sleep(0.2)
    return time.monotonic() - start


def train_demo_behind_nat(lab, tmp_path: Path, *, expect_direct: bool) -> dict:
    swarm = Swarm(len(lab.hosts), tmp_path, lab=lab, env={**FAST_ENV, "SHOAL_HEARTBEAT_INTERVAL_S": "1"})
    public, homes = swarm.nodes[0], swarm.nodes[1:]
    try:
        swarm.start(watch_interval_s=0.5)
        wait_for(lambda: reach(public).get("status") == "public" and reach(public).get("relaying")
                 and all(reach(n).get("status") == "private" and reach(n).get("relay_addrs") for n in homes),
                 60, "the public node relays and both home nodes know they are private, with relayed addresses",
                 swarm)
        a, b = homes
        if expect_direct:
            wait_for(lambda: all(n.status.get("connected_peers") == 2 and not reach(n).get("relayed_only_peers")
                                 for n in homes), 60, "the home nodes punch through to each other", swarm)
        else:
            wait_for(lambda: b.peer_id in reach(a).get("relayed_only_peers", []), 60,
                     "the home nodes reach each other through the relay", swarm)
        wait_for(swarm.all_see_all, 60, "every node sees the others", swarm)
        fields = spec_fields(ROOT / "examples" / "tiny-task.toml")
        use_local_corpus(fields)
        run = TaskRun(swarm, fields)
        swarm.task_id = run.publish()
        wait_for(lambda: run.done() or bool(run.stopped()), 600, "the demo task finishes", swarm)
        run.collect()
        if not expect_direct:
            # Punching between these NATs cannot work: the pair stayed relayed throughout, and the public
            # node fetched verified copies of the home nodes' slices for them.
            assert b.peer_id in reach(a).get("relayed_only_peers", []), reach(a)
            copies = {n.index: run.final[n.peer_id].get("nat_copies") or {} for n in swarm.nodes}
            assert all(c.get("copies_requested", 0) > 0 for c in (copies[a.index], copies[b.index])), copies
            assert copies[public.index].get("copies_served", 0) > 0, copies
    finally:
        swarm.stop()
    report = run.report()
    ok, why = run.ok(report)
    assert ok, why
    rounds = report["task"]["rounds"]
    assert [r["round"] for r in rounds] == list(range(fields["rounds"]))
    # Every node, the home nodes too, trained and agreed in every round.
    assert all(len(r["weights_hash_by_node"]) == 3 and r["members"] == 3 for r in rounds), rounds
    relayed = {n.peer_id: (run.final[n.peer_id].get("reachability") or {}).get("relayed_bytes", {})
               for n in swarm.nodes}
    assert not any(p.startswith(SHARD_PROTOCOL_PREFIX) for r in relayed.values() for p in r), relayed
    return {"relayed_bytes": relayed, "rounds": len(rounds)}


@pytest.mark.timeout(900)
def test_two_full_cone_homes_punch_through_and_train_the_demo_task(nat_lab_factory, tmp_path):
    lab = nat_lab_factory(1, ["full_cone", "full_cone"])
    train_demo_behind_nat(lab, tmp_path, expect_direct=True)


@pytest.mark.timeout(900)
def test_a_symmetric_home_cannot_punch_yet_trains_every_round(nat_lab_factory, tmp_path):
    """Symmetric against port-restricted: no TCP hole punch can work; bulk data goes through the public node."""
    lab = nat_lab_factory(1, ["port_restricted", "symmetric"])
    train_demo_behind_nat(lab, tmp_path, expect_direct=False)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("offered, protocol", [("nat-pmp", "NAT-PMP"), ("upnp", "UPnP IGD")])
def test_a_home_router_that_maps_ports_makes_its_node_public(nat_lab_factory, tmp_path, offered, protocol):
    """p0's router runs miniupnpd (NAT-PMP or UPnP IGD); p1's offers nothing. Both are port-restricted NATs."""
    reason = netlab_portmap.unavailable_reason()
    if reason:
        pytest.skip(reason)
    lab = nat_lab_factory(1, ["port_restricted", "port_restricted"])
    netlab_portmap.offer_port_mapping(lab, "p0", tmp_path / "router", protocols=(offered,))
    swarm = Swarm(3, tmp_path, lab=lab, env={**FAST_ENV, "SHOAL_PORT_MAPPING": "true"})
    public, mapped, unmapped = swarm.nodes
    router_ip = lab.home_of("p0")["public_address"]
    try:
        swarm.start(watch_interval_s=0.5)
        took_s = wait_for(lambda: reach(mapped).get("status") == "public"
                          and reach(unmapped).get("status") == "private"
                          and (reach(unmapped).get("port_mapping") or {}).get("status") == "unavailable",
                          60, "the node whose router maps its port is public and the other private", swarm)
        mapping = reach(mapped)["port_mapping"]
        assert (mapping["status"], mapping["protocol"], mapping["external_address"], mapping["external_port"]) == \
            ("mapped", protocol, router_ip, 4001), mapping
        why = reach(unmapped)["port_mapping"]["reason"]
        assert "answers no NAT-PMP" in why and "no UPnP (SSDP) answer" in why, why
        # The router's word is not enough: peers dialed the mapped port back on fresh connections.
        assert f"/ip4/{router_ip}/tcp/4001/p2p/{mapped.peer_id}" in reach(mapped)["public_addrs"], reach(mapped)
        assert f"dnat ip to {lab.host('p0').address}:4001" in netlab_portmap.mappings(lab, "p0")
        # It announces that address, not a relayed one, and the other home dials it directly.
        wait_for(lambda: mapped.peer_id in unmapped.peers and mapped.peer_id not in
                 reach(unmapped).get("relayed_only_peers", []) and not reach(mapped).get("relay_addrs"),
                 30, "the other home node reaches the mapped one directly", swarm)
        print(json.dumps({"public_after_s": round(took_s, 1), "mapping": mapping["summary"]}))
    finally:
        swarm.stop()
    # A node that stops deletes its mapping instead of leaving the port open for the lease's hour.
    assert "dnat" not in netlab_portmap.mappings(lab, "p0")


@pytest.mark.timeout(180)
def test_plain_start_behind_nat_is_reachable_by_every_node_within_30_s(nat_lab_factory, tmp_path):
    lab = nat_lab_factory(2, ["port_restricted", "full_cone"])
    swarm = Swarm(3, tmp_path, lab=lab, env=FAST_ENV)  # h0, h1 (public) and p0
    late = None
    try:
        swarm.start(watch_interval_s=0.5)
        data_dir = tmp_path / "plain"
        argv = [sys.executable, "-m", "node.cli", "start", "--data-dir", str(data_dir),
                "--bootstrap", swarm.nodes[0].addr]
        started_at = time.monotonic()
        late = subprocess.Popen(lab.argv_in("p1", argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=str(ROOT), env={**os.environ, **FAST_ENV, "PYTHONPATH": str(ROOT)})
        lines: list[str] = []
        peer_id = ""
        while not peer_id:
            line = late.stdout.readline()
            assert line, f"the plain node exited: {lines[-20:]}"
            lines.append(line)
            if line.startswith("shoal ready "):
                peer_id = line.split("peer_id=")[1].split()[0]
        ready_s = time.monotonic() - started_at
        took_s = wait_for(lambda: all(n.peers.get(peer_id) == "alive" and n.status.get("connected_peers", 0) >= 3
                                      for n in swarm.nodes), 30, "every node is connected to the plain node", swarm)
        assert took_s <= 30, took_s
        lab_info = json.dumps({"ready_s": round(ready_s, 1), "reachable_after_ready_s": round(took_s, 1)})
        print(lab_info)
    finally:
        swarm.stop()
        if late is not None:
            stop([late])
