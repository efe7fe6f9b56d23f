"""Configuration of the node cache; it lives with the data component."""

from __future__ import annotations

from dataclasses import dataclass

from ray_goodput.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Node-local cache of remote files, shared by all ranks and loader workers of a node.

    ``directory``: local (NVMe) path; None means ``RAY_GOODPUT_CACHE_DIR`` or
    ``<tmp>/ray_goodput/cache``. ``capacity_bytes``: LRU limit; None means 80% of the free
    space of that disk, plus what the cache already holds there, when the node's cache
    starts. The first process of a node that
    starts the cache fixes both for the node; later configs that differ are logged and
    ignored. ``lookahead``: samples per rank whose files are fetched ahead of the
    training loop (a file per sample for a FileDataset; for Parquet, rows: a file is
    announced about ``lookahead`` rows before its first row is read).
    ``fetch_concurrency``: parallel downloads of the node's prefetcher.
    ``job_check_interval_s``: how often the cache checks that the jobs that use it are
    alive; it exits within about this long after the last of them is gone.
    """

    directory: str | None = None
    capacity_bytes: int | None = None
    lookahead: int = 512
    fetch_concurrency: int = 16
    job_check_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes < 1:
            raise ConfigError(f"CacheConfig.capacity_bytes must be >= 1 or None, got {self.capacity_bytes}")
        if self.lookahead < 0:
            raise ConfigError(f"CacheConfig.lookahead must be >= 0, got {self.lookahead}")
        if self.fetch_concurrency < 1:
            raise ConfigError(f"CacheConfig.fetch_concurrency must be >= 1, got {self.fetch_concurrency}")
        if not self.job_check_interval_s > 0:
            raise ConfigError(f"CacheConfig.job_check_interval_s must be > 0 seconds, got {self.job_check_interval_s}")
