"""Map-style datasets over files at any storage URI, read through the node cache."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from ray_goodput.data._cache_files import CacheLayout
from ray_goodput.data._config import CacheConfig
from ray_goodput.data._file_readers import CacheReader, DirectReader
from ray_goodput.data._order import permutation
from ray_goodput.data._sources import FileSet, resolve_source
from ray_goodput.errors import DataError
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)
_DEFAULT_CACHE = CacheConfig()


class CachedDataset(torch.utils.data.Dataset):
    """Base of the datasets: a FileSet, a seeded epoch order, a reader.

    ``cache=None`` reads every access from storage; otherwise files go through the node
    cache (the :class:`ray_goodput.data.DataLoader` connects it and prefetches).
    """

    def __init__(
        self, files: FileSet, *, seed: int, shuffle: bool, cache: CacheConfig | None, retry: RetryPolicy | None
    ) -> None:
        self.files = files
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.cache = cache
        self.retry = retry or RetryPolicy()
        self._reader: CacheReader | DirectReader | None = None

    @functools.cached_property
    def fingerprint(self) -> int:
        """63-bit int naming the samples of this dataset (saved in loader states)."""
        return self.files.fingerprint()

    def permutation(self, epoch: int) -> np.ndarray:
        """Sample indices of ``epoch`` in order. Shape: (len(self),)."""
        return permutation(len(self), self.seed, epoch, self.shuffle)

    def file_indices(self, samples: np.ndarray) -> list[int]:
        """Files needed for ``samples``, in first-use order (what prefetch announces)."""
        return [int(i) for i in samples]

    def use_reader(self, reader: CacheReader | DirectReader) -> None:
        """Set by the DataLoader before its workers start (they inherit it)."""
        self._reader = reader

    @property
    def reader(self) -> CacheReader | DirectReader:
        if self._reader is None:  # used without our DataLoader: cache without prefetch
            self._reader = (
                DirectReader(self.retry)
                if self.cache is None
                else CacheReader(CacheLayout.of(self.cache), self.cache.capacity_bytes or 2**62, self.retry)
            )
        return self._reader


class FileDataset(CachedDataset):
    """One file is one sample: ``decode(bytes) -> sample`` (default: the bytes).

    ``source``: a directory URI (all files under it, recursively, sorted by path; a file
    whose name, or a folder below the source it is in, starts with '.' or '_' skipped;
    ``suffixes`` filters) or a list of file URIs on one
    filesystem. Raises DataError for an empty source; a file that cannot be read or
    decoded raises (StorageError / DataError) naming the file when it is accessed.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        decode: Callable[[bytes], Any] | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        suffixes: Sequence[str] = (),
        cache: CacheConfig | None = _DEFAULT_CACHE,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(resolve_source(source, tuple(suffixes)), seed=seed, shuffle=shuffle, cache=cache, retry=retry)
        self.decode = decode

    def __len__(self) -> int:
        return len(self.files.paths)

    def __getitem__(self, index: int) -> Any:
        data = self.reader.read(self.files, index)
        if self.decode is None:
            return data
        try:
            return self.decode(data)
        except Exception as exc:
            raise DataError(
                f"decode of {self.files.uri(index)} failed: "
                f"{type(exc).__name__}: {exc}; fix the file or the decode "
                "function"
            ) from exc
