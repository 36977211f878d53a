"""SHARDCAST inside the daemon: the service, its control routes (publish, fetch jobs) and its metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import trio

from node.control import HttpError, Request, Response
from node.shardcast.fetcher import FetchProgress
from node.shardcast.service import ShardcastConfig, ShardcastService
from node.shardcast.store import ShardStore
from node.uploads import Uploads, allowed_path
from protocol.errors import ShoalError

log = logging.getLogger("shoal.shardcast")

MAX_UPLOAD_BYTES = 64 * 2**30
MAX_FETCHES_SHOWN = 8
"""Fetch jobs listed in /status (the newest): the dashboard's shard progress."""


@dataclass
class FetchJob:
    manifest_id: str
    out: str | None
    state: str = "running"
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_per_s: float = 0.0
    num_sources: int = 0
    error: str = ""
    started_at: float = field(default_factory=time.time)
    seconds: float = 0.0


def parse_manifest_id(text: str) -> bytes:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise HttpError(400, f"{text!r} is not a manifest id (64 hex characters, as `shoal shard publish` prints)")
    return raw


async def start_shardcast(node, nursery: trio.Nursery) -> None:
    store = await trio.to_thread.run_sync(ShardStore.open, node.config.data_dir / "shardcast")
    report = store.last_open_report
    if report is not None:
        log.info("shard store: %s", report)
    config = ShardcastConfig(shard_bytes=node.config.shard_bytes, single_source=node.config.shard_single_source)
    service = ShardcastService(node.host, node.keypair, store, penalize=node.membership.penalize, config=config)
    await nursery.start(service.run)
    node.shardcast = service
    jobs: dict[str, FetchJob] = {}

    uploads = Uploads(node.config.data_dir / "uploads", max_bytes=MAX_UPLOAD_BYTES)

    async def upload(request: Request) -> Response:
        if request.method != "POST":
            raise HttpError(405, "POST {\"name\", \"bytes\"} to begin, then {\"upload_id\", \"offset\", \"data\"}")
        body = request.json()
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        if "upload_id" not in body:
            return Response.json({"upload_id": uploads.begin(body.get("name"), body.get("bytes")).upload_id})
        item = uploads.get(body["upload_id"])
        await trio.to_thread.run_sync(uploads.append, item, body.get("offset"), body.get("data"))
        return Response.json({"upload_id": item.upload_id, "received": item.received})

    async def publish(request: Request) -> Response:
        # Content arrives by upload; a path is read only under the operator's publish_dir, never the data dir.
        if request.method != "POST":
            raise HttpError(405, "POST {\"upload_id\", \"sha256\"} after an upload (or {\"path\"} under publish_dir)")
        body = request.json()
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        if "upload_id" in body:
            item = uploads.finish(uploads.get(body["upload_id"]), body.get("sha256"))
            try:
                manifest = await service.publish_file(item.path, label=item.name)
            finally:
                uploads.discard(item.upload_id)
        else:
            path = allowed_path(body.get("path", ""), publish_dir=node.config.publish_dir,
                                data_dir=node.config.data_dir)
            manifest = await service.publish_file(path)
        from protocol.manifest import manifest_id
        return Response.json({"manifest_id": manifest_id(manifest).hex(), "bytes": manifest.total_bytes,
                              "shards": manifest.num_shards, "label": manifest.label})

    async def run_job(job: FetchJob, raw_id: bytes) -> None:
        def progress(p: FetchProgress) -> None:
            job.bytes_done, job.bytes_total = p.bytes_done, p.bytes_total
            job.bytes_per_s, job.num_sources = p.bytes_per_s, p.num_sources
        started = trio.current_time()
        try:
            manifest = await service.fetch(raw_id, progress=progress)
            job.bytes_done = job.bytes_total = manifest.total_bytes
            if job.out:
                await trio.to_thread.run_sync(service.export_file, manifest, job.out)
            job.state = "done"
        except (ShoalError, OSError, ValueError) as exc:
            job.state, job.error = "failed", str(exc)
            log.warning("fetch %s failed: %s", job.manifest_id, exc)
        except Exception as exc:  # the one supervision point of a fetch job: a bug here must not end the daemon
            job.state, job.error = "failed", f"internal error: {exc!r}"
            log.exception("fetch %s failed", job.manifest_id)
        job.seconds = round(trio.current_time() - started, 3)

    async def fetch(request: Request) -> Response:
        if request.method == "POST":
            body = request.json()
            raw_id = parse_manifest_id(str(body.get("manifest_id", "")))
            out = body.get("out")
            if out is not None and not Path(out).is_absolute():
                raise HttpError(400, "out must be an absolute path")
            job = jobs.get(raw_id.hex())
            if job is None or job.state == "failed":
                job = jobs[raw_id.hex()] = FetchJob(manifest_id=raw_id.hex(), out=out)
                nursery.start_soon(run_job, job, raw_id)
            return Response.json(asdict(job))
        job = jobs.get(request.query.get("id", ""))
        if job is None:
            raise HttpError(404, "no fetch job with that id; start one with POST /shard/fetch")
        return Response.json(asdict(job))

    def stats() -> dict:
        s = service.statistics()
        return {"bytes_served": s.bytes_served, "bytes_fetched": s.bytes_fetched, "shards_served": s.shards_served,
                "shards_fetched": s.shards_fetched, "shards_rejected": s.shards_rejected,
                "requests_rejected": s.requests_rejected, "limits_hit": s.limits_hit,
                "local_corruptions": s.local_corruptions, "uploads_refused_seeded": s.uploads_refused_seeded,
                "uploads_refused_busy": s.uploads_refused_busy, "uploads_passed_on": s.uploads_passed_on,
                "seed_copies_again": s.seed_copies_again, "streams_reused": s.streams_reused,
                "haves_sent": s.haves_sent, "haves_received": s.haves_received,
                "manifests": len(store.manifest_ids()),
                "fetches": [asdict(j) for j in list(jobs.values())[-MAX_FETCHES_SHOWN:]]}

    def samples():
        s = service.statistics()
        help_peer = "Shard bytes by peer"
        yield "shoal_shard_bytes_served_total", "counter", "Shard bytes uploaded to peers", {}, s.bytes_served
        yield "shoal_shard_bytes_fetched_total", "counter", "Verified shard bytes downloaded", {}, s.bytes_fetched
        for peer, n in s.bytes_served_by_peer.items():
            yield "shoal_shard_peer_bytes_total", "counter", help_peer, {"peer": peer, "direction": "served"}, n
        for peer, n in s.bytes_fetched_by_peer.items():
            yield "shoal_shard_peer_bytes_total", "counter", help_peer, {"peer": peer, "direction": "fetched"}, n
        for reason, n in s.shards_rejected.items():
            yield "shoal_shards_rejected_total", "counter", "Shards refused from peers", {"reason": reason}, n
        for reason, n in s.requests_rejected.items():
            yield ("shoal_shard_requests_rejected_total", "counter", "Inbound manifest/shard streams refused",
                   {"reason": reason}, n)
        for limit, n in s.limits_hit.items():
            yield "shoal_shard_limits_hit_total", "counter", "Caps on peer-driven state reached", {"limit": limit}, n
        yield ("shoal_shard_local_corruptions_total", "counter", "Own stored shards that failed their hash", {},
               s.local_corruptions)
        for reason, n in s.seed_copies_again.items():
            yield ("shoal_shard_seed_copies_again_total", "counter",
                   "Shards this node published and sent once more (past one copy of the set)", {"reason": reason}, n)
        yield ("shoal_shard_uploads_passed_on_total", "counter",
               "Shard uploads begun while the shard was still arriving here", {}, s.uploads_passed_on)
        yield ("shoal_shard_streams_reused_total", "counter", "Shard requests sent on a kept /shoal/shard/2 stream",
               {}, s.streams_reused)
        yield ("shoal_shard_haves_total", "counter", "Haves messages on /shoal/have/1 streams", {"direction": "sent"},
               s.haves_sent)
        yield ("shoal_shard_haves_total", "counter", "Haves messages on /shoal/have/1 streams",
               {"direction": "received"}, s.haves_received)
        yield ("shoal_shard_fetch_bytes_per_second", "gauge", "Rate of the last completed fetch", {},
               s.last_fetch_bytes_per_s)

    node.routes["/shard/upload"] = upload
    node.routes["/shard/publish"] = publish
    node.routes["/shard/fetch"] = fetch
    node.status_sources["shardcast"] = stats
    node.metric_sources.append(samples)
