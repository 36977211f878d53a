"""Reachability in the node's /status and /metrics: public or private, why, and what crossed a relay."""

from __future__ import annotations

from typing import Iterable

import trio

from node.daemon import Node
from node.metrics import Sample

STATUSES = ("public", "private", "unknown")


async def start_nat_status(node: Node, nursery: trio.Nursery) -> None:
    host = node.host

    def status() -> dict:
        stats = host.statistics()
        return {**host.reachability().to_dict(), "relayed_bytes": dict(stats.relayed_bytes_by_protocol),
                "relayed_streams_refused": stats.relayed_streams_refused,
                "relayed_only_peers": sorted(p for p in host.connected_peers() if not host.is_direct(p))}

    def samples() -> Iterable[Sample]:
        r = host.reachability()
        for name in STATUSES:
            yield ("shoal_reachability", "gauge", "1 for this node's reachability as peers' dial-backs show it",
                   {"status": name}, int(r.status == name))
        yield "shoal_relay_addrs", "gauge", "Relays holding a reservation for this node", {}, len(r.relay_addrs)
        yield "shoal_relaying", "gauge", "1 while this node serves as a circuit relay", {}, int(r.relaying)
        if r.port_mapping:
            for name in ("trying", "mapped", "unavailable"):
                yield ("shoal_port_mapping", "gauge", "1 for the state of this node's port mapping on its router",
                       {"status": name}, int(r.port_mapping.get("status") == name))
        stats = host.statistics()
        for protocol, n in stats.relayed_bytes_by_protocol.items():
            yield ("shoal_relayed_bytes_total", "counter", "Stream bytes that crossed a circuit relay, by protocol",
                   {"protocol": protocol}, n)
        yield ("shoal_relayed_streams_refused_total", "counter",
               "Bulk streams refused because the only path to the peer was a relay", {}, stats.relayed_streams_refused)

    node.status_sources["reachability"] = status
    node.metric_sources.append(samples)
