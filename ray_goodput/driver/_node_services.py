"""Start the node services before the training function runs.

Ray Train calls ``after_worker_group_start`` when a worker group is up, before the
training function starts: each worker then get-or-creates its node's checkpoint
uploader without waiting for it, so the actor starts while the model is built and
restored, and the first save finds it running (the save never waits for it anyway).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from ray_goodput.checkpoint._uploader import start_node_uploader

logger = logging.getLogger(__name__)


class NodeServices(WorkerGroupCallback):
    """Creates each node's CheckpointUploader when a worker group starts."""

    def after_worker_group_start(self, worker_group: Any) -> None:
        try:
            worker_group.execute(start_node_uploader)
        except Exception as exc:  # noqa: BLE001 - the first save creates it instead
            logger.warning("could not pre-start the node uploaders (the first save will): %s", exc)
