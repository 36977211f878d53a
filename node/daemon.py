"""The daemon: one root nursery running the host, membership, the control API and the node's services."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections import Counter
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator

import trio

from node import dashboard, hw, identity
from node.fsutil import write_atomic
from node.config import NodeConfig
from node.control import SOCKET_FILE, TOKEN_FILE, Request, Response, ensure_token, serve_control
from node.membership import Membership, Traffic
from node.metrics import Sample, render, task_samples
from node.shardcast.transfer import SHARD_PROTOCOLS
from p2p.api import Host, HostConfig
from protocol.errors import ConfigError
from protocol.keys import Keypair
from protocol.messages import HardwareSummary

log = logging.getLogger("shoal.node")

READY_FILE = "node.json"
BULK_PROTOCOLS = SHARD_PROTOCOLS
"""Shards and updates: never over a relayed connection."""
LOCK_FILE = "node.lock"


def version() -> str:
    try:
        return metadata.version("shoal")
    except metadata.PackageNotFoundError:
        return "0.1.0"


@contextmanager
def lock_data_dir(data_dir: Path) -> Iterator[None]:
    """One daemon per data dir: a second one would share the identity and corrupt the stores."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another shoal node is already running with data dir {data_dir}; "
                              f"stop it, or give this one its own --data-dir") from None
        yield
    finally:
        os.close(fd)


def write_json_atomic(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=1).encode())


class Node:
    """Everything a running node knows, shared by its services and the control API."""

    def __init__(self, *, config: NodeConfig, keypair: Keypair, host: Host, hardware: HardwareSummary,
                 hardware_report: dict):
        self.config, self.keypair, self.host = config, keypair, host
        self.hardware_report = hardware_report
        self.started_at = time.time()
        self.traffic = Traffic()
        self.membership = Membership(config=config, keypair=keypair, host=host, hardware=hardware,
                                     version=version(), traffic=self.traffic)
        self.control_url = ""
        self.control_token = ""
        self.control_refused: Counter[str] = Counter()
        self.routes: dict[str, Callable[[Request], Any]] = {
            "/status": self._status_route, "/peers": self._peers_route, "/metrics": self._metrics_route}
        self.routes.update(dashboard.routes(self))
        self.metric_sources: list[Callable[[], Iterable[Sample]]] = [self._metric_samples, lambda: task_samples(self)]
        self.status_sources: dict[str, Callable[[], Any]] = {}

    # -- control API ------------------------------------------------------------------------------

    def status(self) -> dict:
        stats = self.host.statistics()
        out = {
            "peer_id": self.keypair.peer_id,
            "version": version(),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "addrs": list(self.membership.advertised_addrs()),
            "control_url": self.control_url,
            "roles": self.config.roles,
            "hardware": self.hardware_report,
            "peers": self.membership.table.counts(),
            "connected_peers": stats.connected_peers,
            "banned_peers": self.banned_peers(),
            "bytes": {"sent": stats.bytes_sent, "received": stats.bytes_received},
            "wire_bytes": {"sent": stats.wire_bytes_sent, "received": stats.wire_bytes_received},
            "gossip_bytes_sent": stats.gossip_bytes_sent_by_kind,
            "streams": {"opened": stats.streams_opened, "accepted": stats.streams_accepted},
            "messages": {"in": dict(self.traffic.messages_in), "out": dict(self.traffic.messages_out),
                         "dropped": dict(self.traffic.drops)},
        }
        for name, source in self.status_sources.items():
            out[name] = source()
        return out

    def banned_peers(self) -> list[str]:
        return sorted(p for p in list(self.membership.scores.banned_until) if self.membership.is_banned(p))

    def peers(self) -> list[dict]:
        now = trio.current_time()
        connected = set(self.host.connected_peers())
        rows = []
        for peer_id, record in sorted(self.membership.table.peers.items()):
            a = record.announce
            rows.append({
                "peer_id": peer_id, "state": record.state.value, "connected": peer_id in connected,
                # How we reach it now (a relay carries only control traffic), and whether it announces
                # itself through relays first (it is behind a NAT: see Membership.advertised_addrs).
                "path": None if peer_id not in connected else "direct" if self.host.is_direct(peer_id) else "relayed",
                "behind_nat": bool(a.addrs) and "/p2p-circuit" in a.addrs[0],
                "addrs": list(a.addrs), "version": a.version, "roles": list(a.roles),
                "hardware": {"devices": list(a.hardware.devices), "memory_bytes": a.hardware.memory_bytes,
                             "tflops": a.hardware.tflops},
                "last_seen_s": round(now - record.last_seen, 1), "status": a.control,
                "score": round(self.membership.scores.score(peer_id, now), 1),
            })
        return rows

    async def _status_route(self, request: Request) -> Response:
        return Response.json(self.status())

    async def _peers_route(self, request: Request) -> Response:
        return Response.json({"peer_id": self.keypair.peer_id, "peers": self.peers()})

    async def _metrics_route(self, request: Request) -> Response:
        def samples():
            for source in self.metric_sources:
                yield from source()
        return Response(200, render(samples), "text/plain; version=0.0.4")

    def _metric_samples(self) -> Iterable[Sample]:
        stats = self.host.statistics()
        yield ("shoal_uptime_seconds", "gauge", "Seconds since the node started", {},
               time.time() - self.started_at)
        for state, count in self.membership.table.counts().items():
            yield "shoal_peers", "gauge", "Peers in the peer table by state", {"state": state}, count
        yield "shoal_connected_peers", "gauge", "Open libp2p connections", {}, stats.connected_peers
        yield "shoal_bytes_sent_total", "counter", "Bytes written to peer streams", {}, stats.bytes_sent
        yield "shoal_bytes_received_total", "counter", "Bytes read from peer streams", {}, stats.bytes_received
        yield ("shoal_wire_bytes_total", "counter", "Bytes on the node's TCP connections, all of libp2p's framing, "
               "handshakes and gossip included", {"direction": "sent"}, stats.wire_bytes_sent)
        yield ("shoal_wire_bytes_total", "counter", "Bytes on the node's TCP connections, all of libp2p's framing, "
               "handshakes and gossip included", {"direction": "received"}, stats.wire_bytes_received)
        for topic, n in self.traffic.messages_in.items():
            yield "shoal_messages_in_total", "counter", "Gossip messages accepted", {"topic": topic}, n
        for topic, n in self.traffic.messages_out.items():
            yield "shoal_messages_out_total", "counter", "Gossip messages published", {"topic": topic}, n
        drops = dict(self.traffic.drops)
        drops["gossip_queue_full"] = stats.gossip_dropped_queue_full
        drops["handler_error"] = stats.handler_errors
        for reason, n in drops.items():
            yield "shoal_messages_dropped_total", "counter", "Messages refused, by reason", {"reason": reason}, n
        yield "shoal_gossip_rejected_total", "counter", "Gossip messages our validators rejected", {}, \
            stats.gossip_rejected
        yield "shoal_banned_peers", "gauge", "Peers currently banned", {}, len(self.banned_peers())
        for reason, n in stats.offences.items():
            yield ("shoal_host_refused_total", "counter", "Input refused inside the libp2p host, by reason",
                   {"reason": reason}, n)
        for reason, n in self.control_refused.items():
            yield ("shoal_control_refused_total", "counter", "Control API requests refused before any route ran",
                   {"reason": reason}, n)


ServiceFactory = Callable[[Node, trio.Nursery], Any]
"""Starts extra services (shard distribution, tasks) inside the node's nursery; awaited at start."""


@asynccontextmanager
async def open_host(keypair: Keypair, host_config: HostConfig) -> AsyncIterator[Host]:
    from p2p.host import open_host as open_libp2p_host  # imported late: libp2p costs seconds to import

    async with open_libp2p_host(keypair, host_config) as host:
        yield host


async def run_node(config: NodeConfig, *, services: Iterable[ServiceFactory] = (),
                   host_factory=open_host, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run a node until cancelled. Reports the Node through task_status once it is reachable."""
    with lock_data_dir(config.data_dir):
        keypair = identity.load_or_create(config.data_dir)
        log.info("peer id %s; data dir %s", keypair.peer_id, config.data_dir)
        log.info("config: %s", json.dumps(config.to_dict()))
        report = await trio.to_thread.run_sync(lambda: hw.detect(benchmark=config.hardware_benchmark))
        summary = hw.summary(report)
        hardware = HardwareSummary(devices=tuple(summary["devices"]), memory_bytes=summary["memory_bytes"],
                                   tflops=summary["tflops"])
        host_config = HostConfig(listen_addrs=list(config.listen), mdns=config.mdns,
                                 dial_timeout_s=config.dial_timeout_s, max_connections=config.max_peers * 2,
                                 nat=config.nat, relay_service=config.relay_service,
                                 port_mapping=config.port_mapping,
                                 port_mapping_gateway=config.port_mapping_gateway,
                                 direct_only_protocols=BULK_PROTOCOLS)
        async with host_factory(keypair, host_config) as host:
            node = Node(config=config, keypair=keypair, host=host, hardware=hardware,
                        hardware_report=report.to_dict())
            ready_path = config.data_dir / READY_FILE
            try:
                async with trio.open_nursery() as nursery:
                    node.control_token = ensure_token(config.data_dir)
                    port = await nursery.start(partial(
                        serve_control, config.control_host, config.control_port, node.routes,
                        token=node.control_token, unix_path=config.data_dir / SOCKET_FILE,
                        metrics_listen=config.metrics_listen, refused=node.control_refused))
                    node.control_url = f"http://{config.control_host}:{port}"
                    log.info("control API token in %s (the CLI reads it there; `shoal dashboard` prints the "
                             "dashboard's URL)", config.data_dir / TOKEN_FILE)
                    await nursery.start(node.membership.run)
                    for start_service in services:
                        await start_service(node, nursery)
                    write_json_atomic(ready_path, {
                        "peer_id": keypair.peer_id, "pid": os.getpid(), "control_url": node.control_url,
                        "control_socket": str(config.data_dir / SOCKET_FILE),
                        "addrs": list(node.membership.advertised_addrs()), "started_at": node.started_at})
                    log.info("ready: %s, control API %s", ", ".join(host.listen_addrs()), node.control_url)
                    task_status.started(node)
            finally:
                ready_path.unlink(missing_ok=True)


def read_ready_file(data_dir: Path) -> dict:
    path = data_dir / READY_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no running node found in {data_dir} (no {READY_FILE}); start one with "
                          f"`shoal start --data-dir {data_dir}` or pass --url") from None
    except ValueError:
        raise ConfigError(f"{path} is damaged; restart the node to rewrite it") from None
