"""The services a full node runs beside membership; each starts inside the node's root nursery."""

from __future__ import annotations

from node.daemon import ServiceFactory


def default_services() -> list[ServiceFactory]:
    from node.nat_copies import start_nat_copies
    from node.nat_status import start_nat_status
    from node.shard_api import start_shardcast
    from node.tasks import start_task_service
    return [start_nat_status, start_shardcast, start_nat_copies, start_task_service]
