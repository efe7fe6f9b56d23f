"""Node services: the Ray-level helpers that both node actors (uploader, cache) use.

One actor of a kind per node, named, pinned to its node, detached.

A training worker owns the actors it creates and they die with it, so node services are
*detached*: they survive worker-group restarts and are found again by name. They are
named ``<kind>:<node_id>`` in the ``ray_goodput`` namespace, which is what the Ray
dashboard and ``ray.util.state.list_actors`` show. They end by :func:`shutdown` (called
when a run finishes) or by themselves when the job that created them is gone.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray_goodput._lazy import LazyModule

ray = LazyModule("ray")  # imported by the first process that uses a node service
scheduling = LazyModule("ray.util.scheduling_strategies")

logger = logging.getLogger(__name__)

NAMESPACE = "ray_goodput"
#: Tries of a service's lookup-or-create that fails inside Ray (``get_or_create``), and
#: the pause before the next (times the try's number).
LOOKUP_TRIES = 3
_LOOKUP_PAUSE_S = 0.2


def actor_name(kind: str, node_id: str) -> str:
    return f"{kind}:{node_id}"


def current_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def get_or_create(
    actor_cls: Any,
    kind: str,
    *args: Any,
    node_id: str | None = None,
    max_concurrency: int = 16,
    runtime_env: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """The ``kind`` actor of ``node_id`` (default: this node), created on first use.

    ``actor_cls`` is a ``@ray.remote`` class; ``args``/``kwargs`` go to its constructor
    and are ignored when the actor already exists. Hard node affinity: the service must
    live where its local disk is. ``runtime_env``: the actor's (default: the caller's).
    """
    node_id = node_id or current_node_id()
    extra = {"runtime_env": runtime_env} if runtime_env else {}
    options = actor_cls.options(
        **extra,
        name=actor_name(kind, node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=max_concurrency,
        max_restarts=0,
        scheduling_strategy=scheduling.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    )
    for attempt in range(1, LOOKUP_TRIES):
        try:
            return options.remote(*args, **kwargs)
        except AssertionError:
            # Ray 2.60: when the actor exists, get_if_exists reads its class back from GCS,
            # and while another process is creating it that read can come back empty (an
            # AssertionError inside Ray; ray-project/ray#41324). Seen once in the CI soak.
            logger.warning(
                "looking up the %s service of node %s failed inside Ray (try %d of %d); trying again",
                kind,
                node_id,
                attempt,
                LOOKUP_TRIES,
                exc_info=True,
            )
            time.sleep(_LOOKUP_PAUSE_S * attempt)
    return options.remote(*args, **kwargs)  # the last try: what it meets is raised


def find(kind: str) -> dict[str, Any]:
    """``{node_id: handle}`` of the live ``kind`` actors in the cluster."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != NAMESPACE:
            continue
        name = entry["name"]
        prefix, _, node_id = name.partition(":")
        if prefix != kind or not node_id:
            continue
        try:
            found[node_id] = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # died between listing and lookup
            continue
    return found


def shutdown(kind: str, *, drain_timeout_s: float = 600.0) -> int:
    """Ask every ``kind`` actor to finish its queued work and exit; returns how many.

    Actors that do not answer within ``drain_timeout_s`` are killed; their unfinished
    work is lost but nothing committed is (commits are made only from finished uploads).
    """
    actors = find(kind)
    refs = {node: h.drain_and_exit.remote(drain_timeout_s) for node, h in actors.items()}
    for node, ref in refs.items():
        try:
            ray.get(ref, timeout=drain_timeout_s + 30)
        except ray.exceptions.RayActorError:
            pass  # it exited, as asked
        except Exception as exc:  # noqa: BLE001 - timeouts and dead nodes: kill it
            logger.warning("%s on node %s did not drain (%s); killing it", kind, node, exc)
            ray.kill(actors[node], no_restart=True)
    return len(actors)


def job_alive(job_id_hex: str | None) -> bool:
    """Whether the Ray job ``job_id_hex`` is still running (True when unknown)."""
    if not job_id_hex:
        return True
    try:
        from ray._private import state  # noqa: PLC0415 - private, guarded

        for job in state.jobs():
            if job.get("JobID") == job_id_hex:
                return not job.get("IsDead", False)
    except Exception as exc:  # noqa: BLE001 - never kill a service on a lookup error
        logger.debug("job lookup failed: %s", exc)
    return True
