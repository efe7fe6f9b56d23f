"""Start the node services once a worker group (or a replacement replica) is up.

Ray Train calls ``after_worker_group_start`` (in its controller) once the worker actors
of a group are placed and have initialized their train context, just before the training
function starts. The controller then creates each worker node's checkpoint uploader
without waiting for it: the actor starts (a process and its imports) while the workers
build the model, restore and take their first steps, so the first save finds it running.

Not earlier: while the workers initialize their train context they import Ray Train's
worker module and torch, the critical path of every start, and an uploader process
starting beside them takes CPU from it (docs/design/save-path.md has the numbers).
An uploader already running on the node (every whole-group restart after the first
start) costs nothing here.
"""

from __future__ import annotations

import logging
from typing import Any

import ray.exceptions
from ray.train.v2._internal.execution.callback import ReplicaGroupCallback, WorkerGroupCallback

from ray_goodput.checkpoint import start_node_uploader

logger = logging.getLogger(__name__)


class NodeServices(WorkerGroupCallback, ReplicaGroupCallback):
    """Creates each worker node's CheckpointUploader once the workers are up.

    ``runtime_env``: the workers' (``RunConfig.worker_runtime_env``; ``TorchTrainer``
    passes it), given to the uploaders as well: one that a worker created inherited it
    (storage credentials in its environment variables, for instance). An uploader already
    running on a node (from an earlier run) is used as it is, with the environment it has.
    """

    def __init__(self, runtime_env: dict[str, Any] | None = None) -> None:
        self.runtime_env = dict(runtime_env) if runtime_env else None

    def after_worker_group_start(self, worker_group: Any) -> None:
        self.start(worker_group.get_workers())

    def after_replica_group_start(self, replica_group: Any) -> None:
        """Replica mode replaced a failed replica: its new process may be on a new node."""
        self.start(replica_group.get_workers())

    def start(self, workers: list[Any]) -> None:
        """Create the uploader of every node in ``workers`` (Ray Train's ``Worker``s, with
        ``metadata.node_id``), not waiting for any."""
        for node_id in sorted({w.metadata.node_id for w in workers}):
            try:
                start_node_uploader(node_id, self.runtime_env)
            except (ray.exceptions.RayError, ValueError, TypeError) as exc:  # e.g. a bad runtime env
                # Not fatal: each Checkpointer creates its node's uploader if none is there.
                logger.warning(
                    "could not start the uploader of node %s (its workers' Checkpointer will): %s: %s",
                    node_id,
                    type(exc).__name__,
                    exc,
                )
