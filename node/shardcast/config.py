"""SHARDCAST's knobs and counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.manifest import DEFAULT_SHARD_BYTES

from node.shardcast import transfer


@dataclass(kw_only=True)
class ShardcastConfig:
    shard_bytes: int = DEFAULT_SHARD_BYTES
    max_uploads: int = 4
    """Concurrent shard uploads; a request past it is answered "busy" at once, never queued."""
    max_downloads: int = 4
    inactivity_s: float = 10.0
    base_deadline_s: float = 5.0
    min_rate_bytes_per_s: float = 250e3
    """The overall deadline assumes at least this rate (2 Mbit/s): slow home links and several
    concurrent transfers must not time out; a stalled peer is caught by inactivity_s instead."""
    stream_open_timeout_s: float = 10.0
    stream_idle_s: float = 10.0
    """A fetcher keeps a /shoal/shard/2 stream this long after an exchange for its next request to the same
    holder; a holder waits twice this for one, then closes the stream (charging nobody)."""
    max_idle_streams_per_peer: int = 8
    """Kept streams a holder leaves waiting for one peer's next request; past it, it closes the stream. An honest
    fetcher keeps at most max_downloads idle per holder, and an idle stream is charged for nothing,
    so this bounds what one identity can hold open for free."""
    have_interval_s: float = 0.1
    """At most one Have per manifest per interval: prompt, yet within gossip rate limits."""
    reannounce_interval_s: float = 30.0
    reannounce_manifests: int = 8
    """How many of the newest stored manifests each periodic re-announcement covers. Not keep_manifests:
    a task keeps hundreds, and a Have for each at once floods every peer; older ones are found by query."""
    have_timeout_s: float = 3.0
    """Haves go to each connected peer on its own stream (node/shardcast/haves.py); a peer that has not taken one
    within this is skipped for reannounce_interval_s, and learns what we hold by asking."""
    max_haves_per_s: float = 20.0
    have_burst: int = 16
    """Have messages (each covering up to MAX_HAVES_PER_MESSAGE manifests) leave at most max_haves_per_s
    after a burst of have_burst, so announcements never crowd out the heartbeats and task messages that
    share the gossip queues."""
    pass_on_arriving: bool = True
    """Announce the shards on their way to us and serve them on as they arrive, each one's last bytes only once
    it verified here (node/shardcast/incoming.py); else a shard is served only once it is whole and stored."""
    busy_retry_s: float = 0.25
    """After a holder answers "busy" (its upload slots are full), ask it for nothing for this long."""
    reseed_after_s: float = 3.0
    """A seeding publisher sends a shard again only if, this long after the first copy, nobody announces it."""
    hedge_after_s: float = 1.0
    """With nothing else to ask for, a shard in flight longer than this (and than 3x the median shard)
    is asked of a second holder too: one slow link must not hold up a receiver's last shards."""
    failure_backoff_s: float = 5.0
    max_failures_per_peer: int = 3
    query_interval_s: float = 2.0
    stall_timeout_s: float = 60.0
    """A fetch fails with TransferTimeout after this long without a new verified shard."""
    keep_manifests: int = 3
    serving_grace_s: float = 10.0
    """A manifest released while peers fetch it stays until none has asked for it (its manifest or a shard) for
    this long: a joiner half-way through the weights the swarm just replaced must still find them."""
    max_release_hold_s: float = 120.0
    """...but no longer than this after its release (unless the caller names its own bound): a peer that keeps
    asking must not keep every released manifest on our disk."""
    max_known_manifests: int = 64
    max_streams_per_peer: int = 32
    """Inbound manifest and shard streams one peer may hold open at once; more are reset and charged.
    An honest peer holds at most 2 x max_downloads (transfers and their hedges) plus one query per fetch."""
    max_streams: int = 256
    """Inbound manifest and shard streams from all peers at once; more are reset (not charged: many honest peers)."""
    unknown_requests_per_s: float = 5.0
    unknown_request_burst: int = 40
    """Requests for manifests or shards we do not hold, per peer: honest ones come from a few Haves that
    raced a GC and from one query per query_interval_s; a loop past this is charged."""
    gossip_per_s: float = 40.0
    gossip_burst: int = 64
    """Manifests and Haves per origin: twice what an honest sender's own Have limiter lets out."""
    max_unknown_have_manifests: int = 16
    """Manifests we have not seen yet whose Haves we buffer (the manifest may arrive later)."""
    single_source: bool = False
    """Fetch only from a manifest's publisher and let a publisher serve duplicates at once: the
    baseline that swarming is measured against, not a mode for real swarms."""

    def deadlines(self, concurrent: int = 1) -> transfer.Deadlines:
        """Deadlines for one of ``concurrent`` transfers that share the link's min_rate_bytes_per_s."""
        return transfer.Deadlines(inactivity_s=self.inactivity_s, base_s=self.base_deadline_s,
                                  min_rate_bytes_per_s=self.min_rate_bytes_per_s / max(1, concurrent))

    def download_deadlines(self) -> transfer.Deadlines:
        return self.deadlines(self.max_downloads)

    def upload_deadlines(self) -> transfer.Deadlines:
        return self.deadlines(self.max_uploads)


@dataclass(kw_only=True)
class ShardcastStatistics:
    bytes_served: int = 0
    bytes_fetched: int = 0
    shards_served: int = 0
    shards_fetched: int = 0
    bytes_served_by_peer: dict[str, int] = field(default_factory=dict)
    bytes_fetched_by_peer: dict[str, int] = field(default_factory=dict)
    shards_rejected: dict[str, int] = field(default_factory=dict)
    """Shards we refused from peers, by reason: bad_hash, bad_size, oversize, protocol, timeout."""
    requests_rejected: dict[str, int] = field(default_factory=dict)
    """Inbound manifest/shard streams we refused, by reason: garbage, oversize, truncated, silent, stalled,
    too_many_streams, unknown_flood (each charged to the peer as ``shard_<reason>``), reset (not charged)."""
    limits_hit: dict[str, int] = field(default_factory=dict)
    """Times a cap on what peers can make us hold was reached, by cap: streams_total, known_manifests,
    holders, unknown_have_manifests, gossip_flood, have_flood."""
    local_corruptions: int = 0
    """Our own stored shards that failed their hash when read: a local disk fault, charged to nobody."""
    uploads_refused_busy: int = 0
    uploads_refused_seeded: int = 0
    """Requests a seeding publisher sent to the swarm instead (it already sent that shard out)."""
    uploads_passed_on: int = 0
    """Uploads begun while the shard was still arriving here (served on as it came, incoming.py)."""
    seed_copies_again: dict[str, int] = field(default_factory=dict)
    """Uploads a seeding publisher began of a shard it had sent out already, by why (node/shardcast/seed.py
    Seed.reason): overdue, unheard, unreachable. Each one that completes is upload past one copy of the set."""
    upload_failures: int = 0
    download_failures: int = 0
    streams_reused: int = 0
    """Shard requests sent on a kept stream rather than a new one (/shoal/shard/2)."""
    gossip_rejected: int = 0
    haves_sent: int = 0
    """Haves messages written to peers' Have streams, one per peer reached."""
    haves_received: int = 0
    uploads_active: int = 0
    downloads_active: int = 0
    last_fetch_bytes_per_s: float = 0.0

    def hit_limit(self, limit: str) -> None:
        self.limits_hit[limit] = self.limits_hit.get(limit, 0) + 1
