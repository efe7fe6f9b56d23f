"""Health checks for the Recovery tests, in a module that imports neither torch nor Ray
Train: each check runs in a fresh process on every node, which imports this module."""

from __future__ import annotations

import time
from pathlib import Path

import ray


class FailsOn:
    """A health check that fails on one node (and records where it ran)."""

    def __init__(self, node_id: str, out: str) -> None:
        self.node_id, self.out = node_id, out

    def __call__(self) -> bool:
        node = ray.get_runtime_context().get_node_id()
        Path(self.out, f"check-{node}-{time.time_ns()}").touch()
        return node != self.node_id


class FailsWhileBusy:
    """A health check that fails on one node while a file exists (the failed group's
    workers still hold that node's GPUs), and records where it ran."""

    def __init__(self, node_id: str, busy: str, out: str) -> None:
        self.node_id, self.busy, self.out = node_id, busy, out

    def __call__(self) -> bool:
        node = ray.get_runtime_context().get_node_id()
        healthy = node != self.node_id or not Path(self.busy).exists()
        # Recorded once judged: a test that removes the file when the records are there must
        # not change a verdict not yet made (the record came first, and a check that read
        # the file a moment after its record passed, once in a suite run).
        Path(self.out, f"check-{node}-{time.time_ns()}").touch()
        return healthy
