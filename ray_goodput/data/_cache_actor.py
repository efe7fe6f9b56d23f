"""NodeCache: the per-node data cache actor (named ``cache:<node_id>``, detached).

A thin Ray shell around :class:`~ray_goodput.data._cache_keeper.CacheKeeper`: it adds Ray
metrics, a once-a-second maintenance thread, and its own exit when the job that created
it is gone. Training processes call it only to announce files (``prefetch``, fire and
forget); cache hits never reach it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from ray_goodput._lazy import LazyModule
from ray_goodput.data._cache_keeper import CacheKeeper
from ray_goodput.data._config import CacheConfig
from ray_goodput.data._metrics import CacheMetrics
from ray_goodput.data._sources import FileSet
from ray_goodput.runtime import _services

logger = logging.getLogger(__name__)

ray = LazyModule("ray")  # a loader without Ray (its cache in-process) never imports it
KIND = "cache"
MAINTAIN_INTERVAL_S = 1.0
_STATUS_FIELDS = (
    "node_id",
    "directory",
    "bytes_used",
    "capacity_bytes",
    "files",
    "hit_rate",
    "hits",
    "misses",
    "evictions",
    "bytes_fetched",
    "inflight",
    "errors",
)


class NodeCache:
    """One per node, an actor made by :func:`_actor_class`. Construct through
    :func:`get_cache`, never directly."""

    def __init__(self, config: CacheConfig, job_id: str | None) -> None:
        node_id = _services.current_node_id()
        self._core = CacheKeeper(config, node_id)
        self._metrics = CacheMetrics(node_id)
        self._jobs = {job_id} if job_id else set()  # the jobs that use it; it exits with the last
        self._job_check_s = config.job_check_interval_s
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="rg-cache-maintain", daemon=True).start()

    def _loop(self) -> None:
        last_job_check = time.monotonic()
        while not self._stop.wait(min(MAINTAIN_INTERVAL_S, self._job_check_s)):
            try:
                self._metrics.publish(self._core.stats(), self._core.drain_latencies())
            except Exception as exc:  # noqa: BLE001 - keep serving; say why
                logger.warning("node cache maintenance failed: %s", exc)
            if time.monotonic() - last_job_check >= self._job_check_s:
                last_job_check = time.monotonic()
                jobs = set(self._jobs)
                gone = {job for job in jobs if not _services.job_alive(job)}
                self._jobs -= gone
                if gone and not self._jobs:
                    logger.info("job(s) %s gone, no other job uses it; node cache exits", sorted(gone))
                    # exit_actor must run in an actor task, not in this thread.
                    ray.get_runtime_context().current_actor.drain_and_exit.remote(5.0)
                    return

    def describe(self) -> dict:
        return self._core.describe()

    def attach(self, job_id: str | None) -> dict:
        """A client of job ``job_id`` uses this cache (it lives while any such job does);
        returns :meth:`describe`."""
        if job_id:
            self._jobs.add(job_id)
        return self._core.describe()

    def register(self, files: FileSet) -> int:
        return self._core.register(files)

    def prefetch(self, fileset_id: int, indices: list[int]) -> int:
        return self._core.prefetch(fileset_id, indices)

    def stats(self) -> dict:
        return self._core.stats()

    def drain_and_exit(self, timeout_s: float) -> None:
        """Finish downloads in flight (up to ``timeout_s``), then exit the actor."""
        self._stop.set()
        self._core.close(timeout_s)
        ray.actor.exit_actor()


@functools.cache
def _actor_class() -> Any:
    """The ``@ray.remote`` NodeCache (made at first use: that imports Ray)."""
    return ray.remote(NodeCache)


def get_cache(config: CacheConfig, node_id: str | None = None):
    """Handle of this node's (or ``node_id``'s) NodeCache, created on first use."""
    job_id = ray.get_runtime_context().get_job_id()
    return _services.get_or_create(_actor_class(), KIND, config, job_id, node_id=node_id)


def cache_status(timeout_s: float = 10.0) -> list[dict]:
    """One dict per live node cache, sorted by node id: ``node_id``, ``directory``,
    ``bytes_used``, ``capacity_bytes``, ``files``, ``hit_rate`` (0..1), ``hits``,
    ``misses``, ``evictions``, ``bytes_fetched``, ``inflight``, ``errors``. A cache that
    does not answer within ``timeout_s`` is listed with ``error`` set. Needs ``ray.init``."""
    refs = {node: handle.stats.remote() for node, handle in _services.find(KIND).items()}
    out = []
    for node, ref in sorted(refs.items()):
        try:
            stats = ray.get(ref, timeout=timeout_s)
            out.append({k: stats[k] for k in _STATUS_FIELDS})
        except Exception as exc:  # noqa: BLE001 - report, do not fail the whole listing
            logger.warning("node cache on %s did not answer: %s", node, exc)
            out.append({"node_id": node, "error": f"{type(exc).__name__}: {exc}"})
    return out
