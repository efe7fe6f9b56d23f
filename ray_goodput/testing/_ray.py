"""One Ray instance per test process, of one kind at a time, started once and shared.

Only one Ray can be initialized in a process, and starting one costs seconds (a
multi-node ``ray.cluster_utils.Cluster`` many more), so a suite starts each kind once:
a single-node ``"local"`` instance or a ``"cluster"`` of several nodes on this machine.
Switching kind shuts the other down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_workers

from ray_goodput.testing._wait import wait_for

logger = logging.getLogger(__name__)

KINDS = ("local", "cluster")


@dataclass(frozen=True, kw_only=True)
class ClusterShape:
    """A head node and ``workers`` identical worker nodes."""

    head_cpus: int = 2
    workers: int = 2
    worker_cpus: int = 2
    worker_resources: dict[str, float] = field(default_factory=lambda: {"slot": 1})

    def __post_init__(self) -> None:
        if self.workers < 1 or self.worker_cpus < 1 or self.head_cpus < 0:
            raise ValueError("ClusterShape needs workers >= 1, worker_cpus >= 1, head_cpus >= 0")


# Ray Train restarts right after a removed node's workers died, while its view of the
# cluster still counts that node: it waits out its worker-group start timeout (60 s by
# default) for a placement group that cannot be placed, then tries again. On the test
# cluster the node is known dead in ~1.5 s instead of ~15 s (3 s x 5 missed checks; a
# killed raylet refuses at once, a slow but live one still has the default timeout per
# check) and the wait is 5 s: the timeout bounds only the placement-group wait (0.0 s
# here when the resources exist, the workers' start is not counted). A start timed out
# under load is retried (Train's controller_failure_limit is unbounded by default): it
# costs time, not the test.
_FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
_CLUSTER_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5"}


class RayCluster:
    """A multi-node cluster on this machine that keeps its worker nodes topped up.

    A test that pulls a node (:meth:`remove`) may call :meth:`top_up` to add a fresh
    one back; the next test gets a full cluster either way.
    """

    def __init__(self, shape: ClusterShape, env: dict[str, str] | None = None) -> None:
        self.shape = shape
        self.env = dict(env or {})  # every node's raylet environment, which its workers inherit
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": shape.head_cpus, "_system_config": _FAST_NODE_DEATH, "env_vars": self.env},
        )
        self._workers: dict[str, Any] = {}
        self.top_up()

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def worker_ids(self) -> list[str]:
        """Node ids of the live worker nodes (the head is not one)."""
        return list(self._workers)

    def remove(self, node_id: str, *, timeout_s: float = 60.0) -> None:
        """Kill a worker node at once (no graceful drain) and wait until every worker
        process it ran has exited (they notice their raylet's death a moment later: a
        test that lets the world go on right away could still see them act)."""
        pids = _worker_pids(node_id)
        self.cluster.remove_node(self._workers.pop(node_id), allow_graceful=False)
        wait_for(
            lambda: not any(_running(pid) for pid in pids),
            timeout_s=timeout_s,
            what=f"the worker processes {sorted(pids)} of removed node {node_id} to exit",
        )

    def top_up(self) -> None:
        """Add fresh worker nodes until there are ``shape.workers`` (main thread only:
        ``Cluster.add_node`` requires it)."""
        while len(self._workers) < self.shape.workers:
            node = self.cluster.add_node(
                num_cpus=self.shape.worker_cpus, resources=dict(self.shape.worker_resources), env_vars=self.env
            )
            self._workers[node.node_id] = node
        self.cluster.wait_for_nodes()

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _worker_pids(node_id: str) -> set[int]:
    workers = list_workers(filters=[("node_id", "=", node_id)], limit=10_000, raise_on_missing_output=False)
    return {w.pid for w in workers if w.pid}


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie nobody reaped yet is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class SharedRay:
    """The Ray instance of this process: ``use(kind)`` starts it or switches to it.

    ``cluster_env``: environment variables of a cluster's nodes (their raylets'; the
    workers inherit them). The local instance's processes inherit this process's
    environment: set it before the first ``use``, and before other threads read it.

    Variables given so, not as a job's ``runtime_env``, cost the workers nothing: Ray
    starts each worker of a job or actor with a ``runtime_env`` through its runtime-env
    agent and a setup process that then execs the worker (docs/testing.md has its cost).
    """

    def __init__(
        self, *, cluster_env: dict[str, str] | None = None, local_cpus: int = 4, shape: ClusterShape | None = None
    ) -> None:
        self.cluster_env = dict(cluster_env or {})
        self.local_cpus = local_cpus
        self.shape = shape or ClusterShape()
        self.kind: str | None = None
        self.cluster: RayCluster | None = None

    def use(self, kind: str) -> RayCluster | None:
        """Make ``kind`` the running instance; returns the cluster for ``"cluster"``."""
        if kind not in KINDS:
            raise ValueError(f"unknown Ray kind {kind!r}: use one of {KINDS}")
        if self.kind != kind:
            self.stop()
            self._start(kind)
        return self.cluster

    def _start(self, kind: str) -> None:
        logger.info("starting the shared %s Ray instance", kind)
        if kind == "local":
            ray.init(address="local", num_cpus=self.local_cpus, include_dashboard=False, log_to_driver=False)
        else:
            self.cluster = RayCluster(self.shape, {**self.cluster_env, **_CLUSTER_ENV})
            ray.init(address=self.cluster.address, log_to_driver=False)
        self.kind = kind

    def stop(self) -> None:
        """Shut down the instance this object started, if any (never one a test started
        on its own)."""
        if self.kind is not None and ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        self.kind = None
