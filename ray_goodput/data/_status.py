"""What the node caches of the cluster hold (for ``ray-goodput status``)."""

from __future__ import annotations

import logging

import ray

from ray_goodput.node import _services

logger = logging.getLogger(__name__)
_FIELDS = ("node_id", "directory", "bytes_used", "capacity_bytes", "files", "hit_rate",
           "hits", "misses", "evictions", "bytes_fetched", "inflight", "errors")


def cache_status(timeout_s: float = 10.0) -> list[dict]:
    """One dict per live node cache, sorted by node id: ``node_id``, ``directory``,
    ``bytes_used``, ``capacity_bytes``, ``files``, ``hit_rate`` (0..1), ``hits``,
    ``misses``, ``evictions``, ``bytes_fetched``, ``inflight``, ``errors``. A cache that
    does not answer within ``timeout_s`` is listed with ``error`` set. Needs ``ray.init``."""
    from ray_goodput.node._cache import KIND  # noqa: PLC0415 - import cycle

    actors = _services.find(KIND)
    refs = {node: handle.stats.remote() for node, handle in actors.items()}
    out = []
    for node, ref in sorted(refs.items()):
        try:
            stats = ray.get(ref, timeout=timeout_s)
            out.append({k: stats[k] for k in _FIELDS})
        except Exception as exc:  # noqa: BLE001 - report, do not fail the whole listing
            logger.warning("node cache on %s did not answer: %s", node, exc)
            out.append({"node_id": node, "error": f"{type(exc).__name__}: {exc}"})
    return out
