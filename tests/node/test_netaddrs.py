"""Announced addresses: 0.0.0.0 becomes each interface's address, loopback last."""

from node import netaddrs


def test_unspecified_listen_address_expands_to_interfaces(monkeypatch):
    monkeypatch.setattr(netaddrs, "interface_ipv4_addresses", lambda: ["10.1.2.3", "127.0.0.1"])
    assert netaddrs.expand_unspecified(["/ip4/0.0.0.0/tcp/4001/p2p/X", "/ip6/::/tcp/4001/p2p/X",
                                        "/ip4/127.0.0.1/tcp/5/p2p/X"]) == [
        "/ip4/10.1.2.3/tcp/4001/p2p/X", "/ip4/127.0.0.1/tcp/4001/p2p/X", "/ip4/127.0.0.1/tcp/5/p2p/X"]


def test_this_host_has_at_least_loopback():
    addresses = netaddrs.interface_ipv4_addresses()
    assert "127.0.0.1" in addresses and addresses[-1] == "127.0.0.1"
