"""What a node advertises over mDNS: its interfaces' addresses, never the 0.0.0.0 it listens on."""

from __future__ import annotations

from libp2p.discovery.mdns.broadcaster import PeerBroadcaster

from p2p import interfaces
from p2p.interfaces import advertise_dialable_over_mdns


def test_unspecified_becomes_the_non_loopback_interfaces():
    assert interfaces.link_dialable(["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001", "/ip4/127.0.0.1/tcp/5"],
                                    ["10.89.0.2", "172.17.0.1", "127.0.0.1"]) == [
        "/ip4/10.89.0.2/tcp/4001", "/ip4/172.17.0.1/tcp/4001", "/ip4/127.0.0.1/tcp/5"]


def test_loopback_is_used_only_when_it_is_the_only_interface():
    assert interfaces.link_dialable(["/ip4/0.0.0.0/tcp/4001"], ["127.0.0.1"]) == ["/ip4/127.0.0.1/tcp/4001"]


def test_the_mdns_txt_records_carry_interface_addresses(monkeypatch):
    monkeypatch.setattr(interfaces, "interface_ipv4_addresses", lambda: ["10.89.0.2", "127.0.0.1"])
    peer_id = "12D3KooWGvEMsQjWT29eEiQMmkGc6Q57NdrqHgaU4o7P7D2BGt68"
    broadcaster = PeerBroadcaster(zeroconf=None, service_type="_p2p._udp.local.", service_name="x._p2p._udp.local.",
                                  peer_id=peer_id, port=4001, listen_addrs=["/ip4/0.0.0.0/tcp/4001"])
    advertise_dialable_over_mdns(broadcaster)
    broadcaster._build_service_info(broadcaster._resolve_host_addrs())  # what register() does
    assert broadcaster.service_info.properties == {b"dnsaddr": f"/ip4/10.89.0.2/tcp/4001/p2p/{peer_id}".encode()}
