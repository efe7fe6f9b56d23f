"""Calls on the node uploaders from outside them: from Ray Train's controller (start one
on a node), the CLI (their status) and a restart's resume choice (wait for the saves a dead
attempt handed over). The actor itself is ``_actor``."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ray_goodput._lazy import LazyModule
from ray_goodput.checkpoint.uploader._actor import KIND, _actor_class
from ray_goodput.runtime import _services
from ray_goodput.runtime._resume import root_key
from ray_goodput.storage import StorageLocation

logger = logging.getLogger(__name__)
ray = LazyModule("ray")  # imported by the first call: every one needs a running Ray


def start_node_uploader(node_id: str, runtime_env: dict[str, Any] | None = None) -> None:
    """Find or create the uploader of node ``node_id`` without waiting for it to start.

    Run by Ray Train's controller for every worker node once a worker group has started
    (``driver._node_services``), so the actor is up before the first save needs it.
    ``runtime_env``: the workers' (``RunConfig.worker_runtime_env``), which an uploader
    a worker creates inherits. Settings travel with each job.
    """
    _services.get_or_create(_actor_class(), KIND, node_id, node_id=node_id, max_concurrency=64, runtime_env=runtime_env)


def uploader_status(timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """``stats()`` of every live CheckpointUploader, sorted by node id (with ``error`` set
    when one did not answer within ``timeout_s``). Needs ``ray.init``."""
    refs = {node: h.stats.remote() for node, h in _services.find(KIND).items()}
    out = []
    for node, ref in sorted(refs.items()):
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except Exception as exc:  # noqa: BLE001 - report it, keep listing
            out.append({"node_id": node, "error": f"{type(exc).__name__}: {exc}"})
    return out


#: How long past its own bound an uploader's answer to :func:`wait_for_uploads` may take.
ANSWER_SLACK_S = 10.0


#: How often a wait for the uploaders' answers looks at its ``stop`` event.
_STOP_POLL_S = 0.25


def wait_for_uploads(
    root: str | StorageLocation, *, above: int | None, timeout_s: float, stop: threading.Event | None = None
) -> dict[str, list[int] | None]:
    """Wait until no live node uploader has a job of storage root ``root`` of a step above
    ``above`` (None: any) in flight: the saves of a dead attempt whose workers handed them
    over, which commit without their workers. Each uploader waits at most ``timeout_s``;
    its answer is waited for ``ANSWER_SLACK_S`` more. Returns, per node, the steps still in
    flight when its bound ran out (None: it did not answer); empty: nothing left. ``stop``
    set ends the wait early (within a fraction of a second), the nodes not heard from as
    None: a caller that is ending must not leave a thread inside ``ray.get`` while Ray
    shuts down.

    An uploader that died holds nothing to wait for. Needs ``ray.init``; without it there
    is no uploader."""
    if not ray.is_initialized() or timeout_s <= 0:
        return {}
    key = root_key(root)
    refs = {}
    for node, handle in _services.find(KIND).items():
        try:
            refs[node] = handle.wait_uploads.remote(key, above, timeout_s)
        except AttributeError:  # an uploader of an older ray_goodput, without the call
            logger.warning("the uploader on node %s cannot say what it is still uploading", node)
    deadline = time.monotonic() + timeout_s + ANSWER_SLACK_S
    left: dict[str, list[int] | None] = {}
    for node, ref in sorted(refs.items()):
        try:
            steps = _get(ref, deadline, stop)
        except ray.exceptions.RayActorError:  # it died, and its jobs with it
            continue
        except ray.exceptions.GetTimeoutError:
            left[node] = None
            continue
        except ray.exceptions.RayError as exc:  # its call failed: nothing known to wait for there
            logger.warning("the uploader on node %s could not say what it is still uploading: %s", node, exc)
            continue
        if steps:
            left[node] = steps
    return left


def _get(ref: Any, deadline: float, stop: threading.Event | None) -> Any:
    """``ray.get(ref)`` until ``deadline`` (a ``time.monotonic()``), in slices that look at
    ``stop``; GetTimeoutError when either ends it first."""
    while True:
        left = max(0.0, deadline - time.monotonic())
        if stop is None:
            return ray.get(ref, timeout=left)
        try:
            return ray.get(ref, timeout=min(left, _STOP_POLL_S))
        except ray.exceptions.GetTimeoutError:
            if stop.is_set() or time.monotonic() >= deadline:
                raise
