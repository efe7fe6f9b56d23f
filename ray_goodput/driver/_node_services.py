"""Start the node services before the training function runs.

Ray Train asks ``before_init_train_context`` (in its controller) once the worker actors
of a group are up, before their train context is initialized. The controller then
creates each worker node's checkpoint uploader without waiting for it: the actor starts
(a process and its imports, ~3 s on a slow 2-core machine) while the workers initialize
their train context, set up torch.distributed, build the model and restore, so the
first save finds it running. Created after the worker group had started (as before),
the uploader of a run whose first save comes early was still starting: the first save
waited 3.2 s for it (2 ranks, 36 MB; 0.00 s once created here).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from ray_goodput.checkpoint._uploader import start_node_uploader

logger = logging.getLogger(__name__)


class NodeServices(WorkerGroupCallback):
    """Creates each worker node's CheckpointUploader as soon as the workers are placed.

    ``runtime_env``: the workers' (``RunConfig.worker_runtime_env``; ``TorchTrainer``
    passes it), given to the uploaders as well: one that a worker created inherited it
    (storage credentials in its environment variables, for instance).
    """

    def __init__(self, runtime_env: dict[str, Any] | None = None) -> None:
        self.runtime_env = dict(runtime_env) if runtime_env else None

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        """Create the uploader of every node in ``workers`` (Ray Train's ``Worker``s, with
        ``metadata.node_id``), not waiting for any; adds no train-context argument."""
        try:
            for node_id in sorted({w.metadata.node_id for w in workers}):
                start_node_uploader(node_id, self.runtime_env)
        except Exception as exc:  # noqa: BLE001 - each Checkpointer creates its node's instead
            logger.warning("could not pre-start the node uploaders (each Checkpointer will): %s", exc)
        return {}
