"""When hole punching fails, a private node's shards reach its relayed-only peers through public peers' verified copies.

Bulk data never crosses a relay. So a node that some peer can reach only through a relay asks
one or two public peers it is directly connected to (its relays first: connections it opened
itself) to fetch each manifest it publishes. They fetch it like any other SHARDCAST receiver,
verify every shard, and announce that they hold it; the relayed-only peer then fetches from
them, SHARDCAST being multi-source. Only nodes that know they are public serve such requests.
"""

from __future__ import annotations

import logging

import trio

from node.daemon import Node
from p2p.api import Stream
from p2p.framing import read_frame, write_frame
from protocol.errors import RemoteProtocolError, TransportError

log = logging.getLogger("shoal.nat")

PROTOCOL = "/shoal/fetch-copy/1"
MANIFEST_ID_BYTES = 32
COPIES = 2
"""Public peers asked to hold a copy of each manifest."""
FETCH_TIMEOUT_S = 120.0
MAX_CONCURRENT_COPIES = 4
SCAN_S = 0.25
"""How often to look for manifests we published: SHARDCAST has no publish event to wait on."""


async def start_nat_copies(node: Node, nursery: trio.Nursery) -> None:
    copies = NatCopies(node)
    node.host.set_stream_handler(PROTOCOL, copies.serve)
    nursery.start_soon(copies.run)
    node.status_sources["nat_copies"] = copies.status


class NatCopies:
    def __init__(self, node: Node):
        self.node = node
        self.limiter = trio.CapacityLimiter(MAX_CONCURRENT_COPIES)
        self.requested = 0
        self.served = 0
        self.refused = 0

    def status(self) -> dict:
        return {"copies_requested": self.requested, "copies_served": self.served, "copies_refused": self.refused}

    async def serve(self, stream: Stream) -> None:
        """Fetch the named manifest (verified as every fetch is) and answer 1 once we hold it, else 0."""
        with trio.fail_after(self.node.config.dial_timeout_s):
            mid = await read_frame(stream, MANIFEST_ID_BYTES)
        if mid is None or len(mid) != MANIFEST_ID_BYTES or self.node.host.reachability().status != "public":
            self.refused += 1
            await stream.reset()
            return
        ok = False
        async with self.limiter:
            with trio.move_on_after(FETCH_TIMEOUT_S):
                try:
                    await self.node.shardcast.fetch(mid)
                    ok = True
                except (TransportError, RemoteProtocolError) as exc:
                    log.info("copy of %s for %s not fetched: %s", mid.hex()[:16], stream.remote_peer, exc)
        self.served += ok
        await write_frame(stream, b"\x01" if ok else b"\x00")
        await stream.close()

    async def run(self) -> None:
        """Ask for copies of each manifest we publish while some peer reaches us only through a relay."""
        me = self.node.keypair.peer_id
        store = self.node.shardcast.store
        seen = set(store.manifest_ids())
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(SCAN_S)
                fresh = [m for m in store.manifest_ids() if m not in seen]
                seen.update(fresh)
                host = self.node.host
                if not fresh or all(host.is_direct(p) for p in host.connected_peers()):
                    continue
                helpers = self._helpers()
                for mid in fresh:
                    signed = store.get_manifest(mid)
                    if signed is None or signed.signer != me:
                        continue
                    for helper in helpers:
                        nursery.start_soon(self._ask, helper, mid)

    def _helpers(self) -> list[str]:
        """Directly connected peers likely to be public: our relays first, then peers announcing no relay."""
        host = self.node.host
        relays = [a.split("/p2p/")[1].split("/")[0] for a in host.reachability().relay_addrs]
        direct = [p for p in host.connected_peers() if host.is_direct(p)]
        others = []
        for peer_id in direct:
            record = self.node.membership.table.peers.get(peer_id)
            if record is not None and not any("/p2p-circuit" in a for a in record.announce.addrs):
                others.append(peer_id)
        ordered = [p for p in relays if p in direct] + [p for p in others if p not in relays]
        return ordered[:COPIES]

    async def _ask(self, helper: str, mid: bytes) -> None:
        self.requested += 1
        with trio.move_on_after(FETCH_TIMEOUT_S + 10):
            try:
                stream = await self.node.host.open_stream(helper, PROTOCOL)
                try:
                    await write_frame(stream, mid)
                    await stream.close_write()
                    answer = await read_frame(stream, 1)
                finally:
                    await stream.close()
                if answer != b"\x01":
                    log.info("%s did not take a copy of %s", helper, mid.hex()[:16])
            except TransportError as exc:
                log.debug("asking %s for a copy of %s failed: %s", helper, mid.hex()[:16], exc)
