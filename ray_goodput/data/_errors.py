"""Errors of the data component. Picklable with their message alone, like every library error."""

from __future__ import annotations

from ray_goodput.errors import GoodputError, StorageError


class DataError(GoodputError, ValueError):
    """The data source or a loader state cannot be used: empty source, a state saved for
    another dataset, a world too large for the dataset. The message names the input to fix."""


class CacheFullError(StorageError):
    """The node cache cannot hold a file: it is larger than the cache capacity, or the disk
    is full even after eviction. Raise ``CacheConfig.capacity_bytes`` or free the disk.
    A StorageError (an OSError) that retries do not fix, so they are not attempted."""
