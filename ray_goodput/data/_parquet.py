"""ParquetDataset: one row is one sample; files cached whole on the node."""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ray_goodput.data._config import CacheConfig
from ray_goodput.data._datasets import _DEFAULT_CACHE, CachedDataset
from ray_goodput.data._order import block_permutation
from ray_goodput.data._sources import FileSet, resolve_source
from ray_goodput.errors import DataError
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)
_DECODED_GROUPS = 4  # row groups kept decoded per process; batches of a rank share them


def _row_groups(files: FileSet, policy: RetryPolicy) -> list[list[int]]:
    """Rows of each row group of each file, read from the footers (parallel)."""

    def one(i: int) -> list[int]:
        def _meta() -> list[int]:
            with files.fs.open_input_file(files.paths[i]) as f:
                try:
                    md = pq.ParquetFile(_Transport(f)).metadata
                except _TransportError:
                    raise  # storage: retried
                except Exception as exc:  # the bytes came, and are not Parquet (a damaged footer too)
                    raise DataError(
                        f"{files.uri(i)} is not a readable Parquet file: {type(exc).__name__}: {exc}; "
                        "remove it or filter with suffixes="
                    ) from exc
                return [md.row_group(g).num_rows for g in range(md.num_row_groups)]

        return policy.call(f"read of the Parquet footer of {files.uri(i)}", _meta)

    with ThreadPoolExecutor(16, thread_name_prefix="rg-parquet") as pool:
        return list(pool.map(one, range(len(files.paths))))


class ParquetDataset(CachedDataset):
    """Rows of Parquet files; a sample is ``{column: value}`` for ``columns`` (default all).

    The epoch order shuffles row groups, then rows within each row group (a uniform
    shuffle over all rows would decode a whole row group per row). Raises DataError for
    an empty source or a file that is not Parquet, naming the file.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        columns: Sequence[str] | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        suffixes: Sequence[str] = (".parquet",),
        cache: CacheConfig | None = _DEFAULT_CACHE,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(resolve_source(source, tuple(suffixes)), seed=seed, shuffle=shuffle, cache=cache, retry=retry)
        self.columns = list(columns) if columns is not None else None
        groups = _row_groups(self.files, self.retry)
        # One entry per row group (block): its file, index in the file, rows.
        self._blocks = [(f, g, n) for f, sizes in enumerate(groups) for g, n in enumerate(sizes)]
        self._block_rows = [n for _, _, n in self._blocks]
        self._starts = np.concatenate([[0], np.cumsum(self._block_rows, dtype=np.int64)])
        if self._starts[-1] == 0:
            raise DataError(f"Parquet source {source!r} has no rows")
        self._decoded: OrderedDict[int, pa.Table] = OrderedDict()

    @functools.cached_property
    def fingerprint(self) -> int:
        return self.files.fingerprint(self._block_rows)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def permutation(self, epoch: int) -> np.ndarray:
        return block_permutation(self._block_rows, self.seed, epoch, self.shuffle)

    def file_indices(self, samples: np.ndarray) -> list[int]:
        blocks = np.searchsorted(self._starts, samples, side="right") - 1
        files = [self._blocks[b][0] for b in blocks]
        return list(dict.fromkeys(files))  # unique, first-use order

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Rows ``indices`` (torch's batched fetch: one decode per row group per batch)."""
        idx = np.asarray(indices, dtype=np.int64)
        blocks = np.searchsorted(self._starts, idx, side="right") - 1
        out: list[Any] = [None] * len(idx)
        for b in dict.fromkeys(blocks.tolist()):
            where = np.nonzero(blocks == b)[0]
            rows = self._group(b).take(pa.array(idx[where] - self._starts[b])).to_pylist()
            for pos, row in zip(where, rows):
                out[pos] = row
        return out

    def _group(self, block: int) -> pa.Table:
        if block in self._decoded:
            self._decoded.move_to_end(block)
            return self._decoded[block]
        f, g, _ = self._blocks[block]
        table = self._read_group(f, g)
        self._decoded[block] = table
        while len(self._decoded) > _DECODED_GROUPS:
            self._decoded.popitem(last=False)
        return table

    def _read_group(self, f: int, g: int) -> pa.Table:
        """Row group ``g`` of file ``f``. A failed read of the file's bytes (a 5xx, a reset
        connection) is retried by the dataset's RetryPolicy and ends as a StorageError;
        bytes that do not decode are a DataError (pyarrow raises OSError for both: the
        file's reads are told apart by :class:`_Transport`)."""

        def read() -> pa.Table:
            with self.reader.open(self.files, f) as src:
                try:
                    return pq.ParquetFile(_Transport(src)).read_row_group(g, columns=self.columns)
                except _TransportError:
                    raise
                except Exception as exc:  # the bytes came, and are not what they should be
                    raise DataError(
                        f"reading row group {g} of {self.files.uri(f)} failed: {type(exc).__name__}: {exc}"
                    ) from exc

        return self.retry.call(f"read of row group {g} of {self.files.uri(f)}", read)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_decoded": OrderedDict()}


class _TransportError(OSError):
    """A read of a Parquet file's bytes failed (storage), as opposed to their decoding."""


class _Transport:
    """The file a row group is decoded from: its own read errors are ``_TransportError``s,
    so that one failed read is retried and a file that does not decode is not. pyarrow
    reads a Python file through these methods and raises their exceptions as they are."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def read(self, n: int = -1) -> bytes:
        try:
            return self._f.read(n)
        except Exception as exc:
            raise _TransportError(f"{type(exc).__name__}: {exc}") from exc

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            return self._f.seek(offset, whence)
        except Exception as exc:
            raise _TransportError(f"{type(exc).__name__}: {exc}") from exc

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        pass  # the caller's ``with`` closes the file
