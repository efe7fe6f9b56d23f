"""Ray metrics of the checkpoint component (Ray dashboard / Prometheus): the node uploader's
queue and throughput, and failed saves as the workers see them."""

from __future__ import annotations

from ray_goodput._lazy import LazyModule

metrics = LazyModule("ray.util.metrics")  # built only in a process that runs Ray


class SaveMetrics:
    """Worker-side counter ``ray_goodput_checkpoint_failed_saves`` and gauge
    ``ray_goodput_checkpoint_recovery_point_age_s`` (how old the state of the newest
    committed checkpoint is: the work a failure now would lose)."""

    def __init__(self) -> None:
        self._failed = metrics.Counter("ray_goodput_checkpoint_failed_saves", "checkpoint saves that failed")
        self._age = metrics.Gauge(
            "ray_goodput_checkpoint_recovery_point_age_s", "age of the newest committed checkpoint's state"
        )

    def failed(self) -> None:
        self._failed.inc(1)

    def recovery_point_age(self, seconds: float) -> None:
        self._age.set(seconds)


class UploaderMetrics:
    """Gauges and counters of one node's CheckpointUploader, tagged with the node id."""

    def __init__(self, node_id: str) -> None:
        tags = ("node_id",)
        self._tags = {"node_id": node_id}
        self._queue = metrics.Gauge("ray_goodput_uploader_queue", "jobs queued or running", tags)
        self._pending = metrics.Gauge("ray_goodput_uploader_bytes_pending", "bytes not yet durable", tags)
        self._uploaded = metrics.Counter("ray_goodput_uploader_bytes_uploaded", "bytes made durable", tags)
        self._failed = metrics.Counter("ray_goodput_uploader_jobs_failed", "jobs that failed", tags)
        self._seconds = metrics.Histogram(
            "ray_goodput_uploader_upload_seconds",
            "time to upload one rank's shard",
            boundaries=[0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300],
            tag_keys=tags,
        )
        self._n = 0
        self._bytes = 0

    def queued(self, delta_bytes: int, delta_jobs: int) -> None:
        self._n += delta_jobs
        self._bytes += delta_bytes
        self._queue.set(self._n, tags=self._tags)
        self._pending.set(self._bytes, tags=self._tags)

    def uploaded(self, num_bytes: int, seconds: float) -> None:
        self._uploaded.inc(num_bytes, tags=self._tags)
        self._seconds.observe(seconds, tags=self._tags)

    def failed(self) -> None:
        self._failed.inc(1, tags=self._tags)
