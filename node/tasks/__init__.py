"""Tasks over gossip: specs judged by each node, DiLoCo rounds over SHARDCAST with no coordinator."""

from node.tasks.service import TaskOptions, TaskService, start_task_service, task_service

__all__ = ["TaskOptions", "TaskService", "start_task_service", "task_service"]
