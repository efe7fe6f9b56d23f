"""Node health checks run by ``Recovery`` before each attempt (the default GPU check is in
``_gpu_check``).

A check is a plain function run as a Ray task pinned to the node (hard node affinity,
``num_cpus=0`` so it never waits behind the training workers' resources). It passes when it
returns anything but ``False``; raising, returning ``False`` or outliving the timeout marks
the node unhealthy. A task with no GPU request still sees every GPU of its node (Ray 2.60
leaves ``CUDA_VISIBLE_DEVICES`` alone when a task asks for none), which is what a check of
the whole node needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)

HealthCheck = Callable[[], object]


def _run_check(check: HealthCheck) -> str | None:
    """Run ``check`` here; None when healthy, else the reason."""
    try:
        verdict = check()
    except Exception as exc:  # noqa: BLE001 - any failure of a check is a verdict, not a crash
        return f"{type(exc).__name__}: {exc}"
    return "the check returned False" if verdict is False else None


_remote_check = ray.remote(num_cpus=0, max_retries=0)(_run_check)


def start_checks(check: HealthCheck, node_ids: list[str]) -> dict[ray.ObjectRef, str]:
    """Start ``check`` on every node at once; ``{task: node_id}`` for :func:`collect`."""
    return {
        _remote_check.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            name=f"ray_goodput_health_check:{node[:12]}",
        ).remote(check): node
        for node in node_ids
    }


def collect(refs: dict[ray.ObjectRef, str], timeout_s: float) -> dict[str, str]:
    """``{node_id: reason}`` of the unhealthy nodes among started checks.

    Blocks at most ``timeout_s``; a node whose check has not answered by then is unhealthy
    (a hung GPU looks exactly like that) and its task is cancelled.
    """
    if not refs:
        return {}
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=max(0.0, timeout_s))
    unhealthy = {}
    for ref in done:
        try:
            reason = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the task's process died: the node cannot run work
            reason = f"the check's process failed: {type(exc).__name__}: {exc}"
        if reason is not None:
            unhealthy[refs[ref]] = reason
    for ref in pending:
        ray.cancel(ref, force=True)
        unhealthy[refs[ref]] = f"the check did not answer within {timeout_s:g} s"
    return unhealthy


def check_nodes(check: HealthCheck, node_ids: list[str], timeout_s: float) -> dict[str, str]:
    """Run ``check`` on every node at once and wait for the verdicts (:func:`collect`)."""
    return collect(start_checks(check, node_ids), timeout_s)
