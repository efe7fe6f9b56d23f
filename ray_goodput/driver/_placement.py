"""Where a run's workers may go: what one worker asks for, how many fit on the live nodes
outside an exclusion list, the nodes isolated for good, and the label selector that keeps
the worker group off excluded nodes. ``Recovery`` decides which nodes to exclude; this is
the arithmetic and bookkeeping it decides with."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

logger = logging.getLogger(__name__)

#: Ray's built-in node label; a value ``"!in(a,b)"`` keeps bundles off nodes a and b.
NODE_ID_LABEL = "ray.io/node-id"
#: The resource Ray gives each node per accelerator it has, and asks of each worker of a
#: ``ScalingConfig(accelerator_type=...)``.
_ACCELERATOR_PREFIX = "accelerator_type:"


class NodeLedger:
    """Failures per node and the nodes isolated for good (pure bookkeeping)."""

    def __init__(self, max_failures_per_node: int) -> None:
        self.max_failures = max_failures_per_node
        self.failures: dict[str, int] = {}
        self.isolated: list[str] = []

    def record(self, node_id: str, *, may_isolate: Callable[[str], bool] = lambda node: True) -> bool:
        """Count one failure of ``node_id``; True when it is newly isolated by it.
        ``may_isolate(node_id)``: whether the run can do without the node (asked only when
        the node reaches the limit); a node it cannot do without keeps counting."""
        self.failures[node_id] = self.failures.get(node_id, 0) + 1
        if node_id in self.isolated or self.failures[node_id] < self.max_failures:
            return False
        if not may_isolate(node_id):
            return False
        self.isolated.append(node_id)
        return True


def worker_resources(scaling_config: Any) -> dict[str, float]:
    """What one worker asks for, as Ray Train computes it from the public fields (an
    ``accelerator_type`` is a resource of the nodes that have that accelerator)."""
    given = {k: v for k, v in (scaling_config.resources_per_worker or {}).items() if v}
    if not given:
        given = {"GPU": 1.0} if scaling_config.use_gpu else {"CPU": 1.0}
    if scaling_config.use_gpu:
        given.setdefault("GPU", 1.0)
    accelerator = getattr(scaling_config, "accelerator_type", None)
    if accelerator:
        given.setdefault(f"{_ACCELERATOR_PREFIX}{accelerator}", 0.001)
    return given


def admits(labels: dict[str, str], selector: dict[str, str] | None) -> bool:
    """Whether a node with ``labels`` meets a label selector, in Ray's syntax: ``value``,
    ``!value`` (a node without the label meets it), ``in(a,b)``, ``!in(a,b)``. Values are
    taken as written, as Ray's matcher takes them: in ``in(a, b)`` the second is " b"."""
    for key, condition in (selector or {}).items():
        negated = condition.startswith("!")
        body = condition[1:] if negated else condition
        if body.startswith("in(") and body.endswith(")"):
            values = set(body[3:-1].split(","))
        else:
            values = {body}
        if (labels.get(key) in values) == negated:
            return False
    return True


def _eligible(scaling_config: Any, excluded: list[str], nodes: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The live nodes outside ``excluded`` that the user's label selector admits (one
    selector for every worker; a per-worker list is not applied)."""
    user = scaling_config.label_selector
    selector = user if isinstance(user, dict) else None
    return [
        n
        for n in (ray.nodes() if nodes is None else nodes)
        if n["Alive"] and n["NodeID"] not in excluded and admits(n.get("Labels") or {}, selector)
    ]


def fewest_workers(scaling_config: Any) -> int:
    """The smallest group a start may place: ``num_workers``, or an elastic run's minimum."""
    n = scaling_config.num_workers
    return int(n[0] if isinstance(n, tuple) else n)


def workers_that_fit(node_resources: dict[str, float], per_worker: dict[str, float]) -> int:
    return int(min(node_resources.get(r, 0.0) // v for r, v in per_worker.items()))


def room(scaling_config: Any, excluded: list[str], nodes: list[dict[str, Any]] | None = None) -> int:
    """How many workers the live nodes outside ``excluded`` hold (``nodes``: the node
    table, as ``ray.nodes()`` returns it; by default read now)."""
    per_worker = worker_resources(scaling_config)
    return sum(workers_that_fit(n["Resources"], per_worker) for n in _eligible(scaling_config, excluded, nodes))


def candidate_nodes(scaling_config: Any, excluded: list[str], nodes: list[dict[str, Any]] | None = None) -> list[str]:
    """The live nodes outside ``excluded`` that hold at least one worker (``nodes``: as
    :func:`room`'s)."""
    per_worker = worker_resources(scaling_config)
    return [
        n["NodeID"]
        for n in _eligible(scaling_config, excluded, nodes)
        if workers_that_fit(n["Resources"], per_worker) > 0
    ]


def exclusion_selector(scaling_config: Any, excluded: list[str]) -> dict[str, str] | None:
    """The worker group's label selector that keeps it off ``excluded`` (the user's own
    selector kept); None when nothing is excluded, or the user's selector leaves no room
    for the exclusion (per worker, or naming the node label already: logged)."""
    if not excluded:
        return None
    user = scaling_config.label_selector
    if isinstance(user, list) or NODE_ID_LABEL in (user or {}):
        logger.warning(
            "ScalingConfig.label_selector is per worker or names %s already; "
            "Recovery cannot add its node exclusions to it",
            NODE_ID_LABEL,
        )
        return None
    return {**(user or {}), NODE_ID_LABEL: f"!in({','.join(excluded)})"}
