"""A Ray Train callback for the replica-mode tests, installed through ``RAY_TRAIN_CALLBACKS``:
as Ray shuts down the first replica it replaces, it SIGKILLs the replicas still alive, so the
second death lands after the poll that saw the first and before Ray calls the survivors.
Ray 2.60 ends such a run with a ``ControllerError``, and ``ray_goodput.TorchTrainer.fit``
runs it again from the durable checkpoint. A module of its own: the controller imports it."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil
from ray.train.v2._internal.execution.callback import ReplicaGroupCallback, WorkerGroupCallback

_GONE_WITHIN_S = 30.0


class KillSurvivorsAtReplacement(WorkerGroupCallback, ReplicaGroupCallback):
    """Fires once per controller, as Ray shuts down the first replica it replaces."""

    def __init__(self) -> None:
        self._group = None
        self.fired = False

    def after_worker_group_start(self, worker_group) -> None:
        self._group = worker_group

    def before_replica_group_shutdown(self, replica_group) -> None:
        if self.fired or self._group is None:
            return
        self.fired = True
        failed = {w.metadata.pid for w in replica_group.get_workers()}
        pids = [w.metadata.pid for w in self._group.get_workers() if w.metadata.pid not in failed]
        for pid in pids:
            # Already dead when every replica was killed at once (--kill-all-at) and a poll
            # saw one death before the other: Ray replaces one while the other is gone.
            with contextlib.suppress(ProcessLookupError):
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
