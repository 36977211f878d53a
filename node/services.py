"""The services a full node runs beside membership; each starts inside the node's root nursery."""

from __future__ import annotations

from node.daemon import ServiceFactory


def default_services() -> list[ServiceFactory]:
    from node.shard_api import start_shardcast
    return [start_shardcast]
