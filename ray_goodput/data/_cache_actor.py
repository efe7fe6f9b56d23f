"""NodeCache: the per-node data cache actor (named ``cache:<node_id>``, detached).

A thin Ray shell around :class:`ray_goodput.data._cache_core.CacheCore`: it adds Ray
metrics, a once-a-second maintenance thread, and its own exit when the job that created
it is gone. Training processes call it only to announce files (``prefetch``, fire and
forget); cache hits never reach it.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.util import metrics

from ray_goodput.data._cache_core import CacheCore
from ray_goodput.data._config import CacheConfig
from ray_goodput.data._sources import FileSet
from ray_goodput.node import _services

logger = logging.getLogger(__name__)

KIND = "cache"
MAINTAIN_INTERVAL_S = 1.0
JOB_CHECK_INTERVAL_S = 10.0
_COUNTERS = ("hits", "misses", "evictions", "bytes_fetched")


class _Metrics:
    """Ray metrics of one node cache, published from stats deltas once a second."""

    def __init__(self, node_id: str) -> None:
        tags = ("node_id",)
        self._tags = {"node_id": node_id}
        self._counters = {name: metrics.Counter(f"ray_goodput_cache_{name}", tag_keys=tags,
                                                description=f"node cache {name}")
                          for name in _COUNTERS}
        self._bytes = metrics.Gauge("ray_goodput_cache_bytes_cached", tag_keys=tags,
                                    description="bytes in the node cache")
        self._latency = metrics.Histogram(
            "ray_goodput_cache_fetch_seconds", tag_keys=tags,
            description="seconds to download one file into the node cache",
            boundaries=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30])
        self._last = dict.fromkeys(_COUNTERS, 0)

    def publish(self, stats: dict, latencies: list[float]) -> None:
        for name in _COUNTERS:
            delta = stats[name] - self._last[name]
            if delta > 0:
                self._counters[name].inc(delta, tags=self._tags)
            self._last[name] = stats[name]
        self._bytes.set(stats["bytes_used"], tags=self._tags)
        for seconds in latencies:
            self._latency.observe(seconds, tags=self._tags)


@ray.remote
class NodeCache:
    """One per node. Construct through :func:`get_cache`, never directly."""

    def __init__(self, config: CacheConfig, job_id: str | None) -> None:
        node_id = _services.current_node_id()
        self._core = CacheCore(config, node_id)
        self._metrics = _Metrics(node_id)
        self._job_id = job_id
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="rg-cache-maintain", daemon=True).start()

    def _loop(self) -> None:
        last_job_check = time.monotonic()
        while not self._stop.wait(MAINTAIN_INTERVAL_S):
            try:
                self._metrics.publish(self._core.stats(), self._core.drain_latencies())
            except Exception as exc:  # noqa: BLE001 - keep serving; say why
                logger.warning("node cache maintenance failed: %s", exc)
            if time.monotonic() - last_job_check >= JOB_CHECK_INTERVAL_S:
                last_job_check = time.monotonic()
                if not _services.job_alive(self._job_id):
                    logger.info("job %s is gone; node cache exits", self._job_id)
                    # exit_actor must run in an actor task, not in this thread.
                    ray.get_runtime_context().current_actor.drain_and_exit.remote(5.0)
                    return

    def describe(self) -> dict:
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


def get_cache(config: CacheConfig, node_id: str | None = None):
    """Handle of this node's (or ``node_id``'s) NodeCache, created on first use."""
    job_id = ray.get_runtime_context().get_job_id()
    return _services.get_or_create(NodeCache, KIND, config, job_id, node_id=node_id)
