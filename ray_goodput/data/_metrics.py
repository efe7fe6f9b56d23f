"""Ray metrics of the data component (the node cache), for the dashboard and Prometheus."""

from __future__ import annotations

from ray_goodput._lazy import LazyModule

metrics = LazyModule("ray.util.metrics")  # built only in a process that runs Ray

_COUNTERS = ("hits", "misses", "evictions", "bytes_fetched")


class CacheMetrics:
    """Metrics of one node cache, published from its stats deltas (about once a second)."""

    def __init__(self, node_id: str) -> None:
        tags = ("node_id",)
        self._tags = {"node_id": node_id}
        self._counters = {
            name: metrics.Counter(f"ray_goodput_cache_{name}", tag_keys=tags, description=f"node cache {name}")
            for name in _COUNTERS
        }
        self._bytes = metrics.Gauge(
            "ray_goodput_cache_bytes_cached", tag_keys=tags, description="bytes in the node cache"
        )
        self._latency = metrics.Histogram(
            "ray_goodput_cache_fetch_seconds",
            tag_keys=tags,
            description="seconds to download one file into the node cache",
            boundaries=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30],
        )
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
