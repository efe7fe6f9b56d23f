"""A Ray Train controller callback for the replica-mode tests, installed through
``RAY_TRAIN_CALLBACKS`` (Ray runs those before the run's own callbacks): when Ray is about to
replace a failed replica, it SIGKILLs the replicas still alive first, so the second death
lands exactly where Ray 2.60 once ended a run with a ``ControllerError`` (between the poll
that saw the first death and the replacement). A module of its own: the controller imports it."""

from __future__ import annotations

import os
import signal
import time

import psutil
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

_GONE_WITHIN_S = 30.0


class KillSurvivorsBeforeReplacement(ControllerCallback, WorkerGroupCallback):
    """Fires once per run, at the first replacement Ray decides on."""

    def __init__(self) -> None:
        self._group = None
        self.fired = False

    def after_worker_group_start(self, worker_group) -> None:
        self._group = worker_group

    def before_controller_execute_resize_decision(self, decision) -> None:
        group = self._group
        status = group.get_latest_poll_status() if group is not None and group.has_started() else None
        if self.fired or status is None or not status.errors:
            return
        self.fired = True
        pids = [w.metadata.pid for i, w in enumerate(group.get_workers()) if i not in status.errors]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _GONE_WITHIN_S
        while any(_running(p) for p in pids):
            if time.monotonic() > deadline:
                raise AssertionError(f"survivor processes {pids} still alive {_GONE_WITHIN_S} s after SIGKILL")
            time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # reaped by its raylet meanwhile
        return False
