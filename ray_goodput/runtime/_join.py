"""Worker side of replica mode's hand-off: how this worker joined, and the mode's settings.

The driver (``driver._replicas.ReplicaSupport``) pushes a :class:`WorkerJoin` into each
worker before its training function starts: ``"start"`` for every worker of a whole-group
start, ``"replacement"`` for a worker Ray started in place of a failed replica while the
others kept running (it restores nothing from storage: it heals from a peer), ``"done"`` for
a replacement whose peers have all finished (it has nothing left to do). ``"done"`` also
replaces the join of a worker still running once every peer has finished (a replacement
still waiting to heal; with ``min_replicas`` >= 2, a replica the last quorums left out):
it ends.
A process-global, like the resume decision: a worker process lives for one join.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Literal

_lock = threading.Lock()
_join: WorkerJoin | None = None


@dataclass(frozen=True)
class WorkerJoin:
    kind: Literal["start", "replacement", "done"]
    settings: dict[str, Any] = field(default_factory=dict)  # ReplicaGroups' fields


def set_join(join: WorkerJoin | None) -> None:
    """Install the driver's word in this worker process (run through the worker group)."""
    global _join  # noqa: PLW0603 - one join per worker process, set by the driver
    with _lock:
        _join = join


def worker_join() -> WorkerJoin | None:
    """How this worker joined, or None when no driver said (a stock trainer: a start)."""
    with _lock:
        return _join
