"""SHARDCAST: verified, multi-source distribution of tensors and files between untrusted peers."""

from node.shardcast.fetcher import FetchProgress
from node.shardcast.service import MANIFEST_PROTOCOL, TOPIC, ShardcastConfig, ShardcastService, ShardcastStatistics
from node.shardcast.store import ShardStore
from node.shardcast.transfer import SHARD_PROTOCOL, SHARD_PROTOCOLS

__all__ = ["FetchProgress", "MANIFEST_PROTOCOL", "SHARD_PROTOCOL", "SHARD_PROTOCOLS", "TOPIC", "ShardStore", "ShardcastConfig",
           "ShardcastService", "ShardcastStatistics"]
