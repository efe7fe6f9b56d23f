"""How a dataset reads one of its files: through the node cache, or straight from storage.

This is the hot path of every DataLoader worker: a hit is ``open()`` + ``read()`` of the
file's deterministic cache path; no actor call, no lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import BinaryIO

from ray_goodput.data._cache_files import CacheLayout, fetch, flock
from ray_goodput.data._journal import journal_writer
from ray_goodput.data._sources import FileSet
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)
_EVICTION_RACE_RETRIES = 5


class CacheReader:
    """Reads files of a FileSet through the cache directory ``layout``. Picklable."""

    def __init__(self, layout: CacheLayout, capacity_bytes: int, policy: RetryPolicy | None = None) -> None:
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.policy = policy or RetryPolicy()
        self.journal = journal_writer(layout.journal_dir)

    def read(self, files: FileSet, i: int) -> bytes:
        """Bytes of file ``i``; downloads it into the cache on a miss (blocking)."""
        with self.open(files, i) as f:
            return f.read()

    def open(self, files: FileSet, i: int) -> BinaryIO:
        """Open file ``i`` from the cache; on a miss, fetch it first (blocking).

        An open file stays readable if it is evicted meanwhile; one evicted between the
        fetch and the open is fetched again."""
        key = files.cache_key(i)
        path = self.layout.data_file(key)
        for attempt in range(_EVICTION_RACE_RETRIES):
            try:
                f = open(path, "rb")  # noqa: SIM115 - returned open: the caller closes it
            except FileNotFoundError:
                got = fetch(
                    self.layout,
                    key,
                    files.fs,
                    files.paths[i],
                    max_bytes=self.capacity_bytes,
                    policy=self.policy,
                    expected=files.sizes[i],
                )
                self.journal.miss(None if got is None else (key, got[0], got[1]))
                continue
            if not self._whole(f, files, i, key):
                continue
            if attempt == 0:
                self.journal.hit()
            return f
        raise FileNotFoundError(
            f"{files.uri(i)} kept being evicted from the cache at {self.layout.root}; raise CacheConfig.capacity_bytes"
        )

    def _whole(self, f: BinaryIO, files: FileSet, i: int, key: str) -> bool:
        """Whether the cache file open as ``f`` has file ``i``'s listed size; if not (cut
        short: renamed into place without an fsync, then the host crashed), it is closed
        and removed, to be fetched again: under the key's lock, and only if it is still
        that file (another reader may have fetched it again meanwhile)."""
        listed = files.sizes[i]
        opened = os.fstat(f.fileno())
        if listed < 0 or opened.st_size == listed:
            return True
        logger.warning(
            "cached copy of %s holds %d of its %d bytes; fetching it again", files.uri(i), opened.st_size, listed
        )
        path = self.layout.data_file(key)
        try:  # f stays open meanwhile: its inode cannot be a fresh copy's
            with flock(self.layout.lock_path(key)), contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                now = os.stat(path)
                if (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino):
                    os.unlink(path)
        finally:
            f.close()
        return False


class DirectReader:
    """Reads straight from storage, every time (``cache=None``)."""

    def __init__(self, policy: RetryPolicy | None = None) -> None:
        self.policy = policy or RetryPolicy()

    def read(self, files: FileSet, i: int) -> bytes:
        def _read() -> bytes:
            with files.fs.open_input_stream(files.paths[i]) as f:
                return f.read()

        return self.policy.call(f"read of {files.uri(i)}", _read)

    def open(self, files: FileSet, i: int):
        """A pyarrow input file of file ``i`` on storage (random access)."""
        return self.policy.call(f"open of {files.uri(i)}", lambda: files.fs.open_input_file(files.paths[i]))
