"""Start the node services before the training function runs.

Ray Train asks ``before_init_train_context`` (in its controller) once the worker actors
of a group are placed, before their train context is initialized. The controller then
creates each worker node's checkpoint uploader without waiting for it: the actor starts
(a process and its imports, seconds on a small machine) while the workers initialize
their train context, set up torch.distributed, build the model and restore, so the
first save finds it running.
"""

from __future__ import annotations

import logging
from typing import Any

import ray.exceptions
from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from ray_goodput.checkpoint import start_node_uploader

logger = logging.getLogger(__name__)


class NodeServices(WorkerGroupCallback):
    """Creates each worker node's CheckpointUploader as soon as the workers are placed.

    ``runtime_env``: the workers' (``RunConfig.worker_runtime_env``; ``TorchTrainer``
    passes it), given to the uploaders as well: one that a worker created inherited it
    (storage credentials in its environment variables, for instance). An uploader already
    running on a node (from an earlier run) is used as it is, with the environment it has.
    """

    def __init__(self, runtime_env: dict[str, Any] | None = None) -> None:
        self.runtime_env = dict(runtime_env) if runtime_env else None

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        """Create the uploader of every node in ``workers`` (Ray Train's ``Worker``s, with
        ``metadata.node_id``), not waiting for any; adds no train-context argument."""
        for node_id in sorted({w.metadata.node_id for w in workers}):
            try:
                start_node_uploader(node_id, self.runtime_env)
            except (ray.exceptions.RayError, ValueError, TypeError) as exc:  # e.g. a bad runtime env
                # Not fatal: each Checkpointer creates its node's uploader if none is there.
                logger.warning(
                    "could not pre-start the uploader of node %s (its workers' Checkpointer will): %s: %s",
                    node_id,
                    type(exc).__name__,
                    exc,
                )
        return {}
