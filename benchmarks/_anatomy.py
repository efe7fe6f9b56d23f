"""Controller-side clocks for ``restart_anatomy.py``: Ray Train callbacks that write the
time of every hook a whole-group restart passes through to one JSONL file.

Two instances run in the controller: one installed through ``RAY_TRAIN_CALLBACKS`` (Ray
puts those before its own callbacks, so its ``after_worker_group_start`` fires before the
backend sets up the process group) and one in ``RunConfig.callbacks`` (after all of Ray's,
so its ``after_worker_group_start`` fires once the process group is up). Both pick the
output path up in the driver, where they are built, from ``ANATOMY_OUT``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback


class Clock(ControllerCallback, WorkerGroupCallback):
    where = "late"

    def __init__(self) -> None:
        self.out = os.environ["ANATOMY_OUT"]
        self._failed_seen = False

    def _mark(self, what: str, **extra: Any) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps({"what": f"{self.where}:{what}", "t": time.time(), **extra}) + "\n")

    # controller
    def on_controller_start_worker_group(self, **kwargs: Any) -> None:
        self._mark("start_worker_group")
        return None

    def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
        self._mark("failure_decision")

    # worker group
    def before_worker_group_start(self, worker_group_context: Any) -> None:
        self._failed_seen = False
        self._mark("before_worker_group_start")

    def before_init_train_context(self, workers: Any) -> dict:
        self._mark("actors_up")
        return {}

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._mark("after_worker_group_start")

    def after_worker_group_training_start(self, worker_group: Any) -> None:
        self._mark("training_started")

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        if worker_group_status.errors and not self._failed_seen:
            self._failed_seen = True
            self._mark("failure_seen")

    def after_worker_group_shutdown(self, worker_group_context: Any) -> None:
        self._mark("shutdown_done")


class EarlyClock(Clock):
    """The instance Ray runs before its own callbacks (``RAY_TRAIN_CALLBACKS``)."""

    where = "early"
