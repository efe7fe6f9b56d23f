"""Read-only memory maps of checkpoint files on a local file system, for restore.

A restore reads a local file (the node-local copy, or a file of a checkpoint in local
storage), checks it, then copies its tensors into the live state. Read into a new buffer,
that is three passes over the bytes plus a page fault per 4 KiB of the new buffer: at
1 GiB the faults cost more than the read. Mapped, the checksum runs over the page cache
itself and the tensors are copied straight from it: measured here on one 1 GiB file in
the page cache, read + check + copy 0.83 s whole-buffer against 0.26 s mapped, where a
plain read alone takes 0.54 s.

The bytes of a mapped file are those of the page cache, so they must not change between
the check and the copy: checkpoint files are written once and replaced by rename, never
rewritten in place (a file deleted while mapped stays readable until unmapped). A file
truncated under a mapping by something else would end the reading process (SIGBUS), and
its worker group would restart. Files that cannot be mapped (empty, or on a file system
without ``mmap``) are read as before.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import pyarrow as pa

from ray_goodput.storage import checksum

logger = logging.getLogger(__name__)


class MappedFile:
    """A file mapped read-only; :meth:`read_at` returns views of it, not copies."""

    def __init__(self, path: str | Path, mapping: mmap.mmap) -> None:
        self.path = str(path)
        self._map: mmap.mmap | None = mapping
        self.size = len(mapping)
        self._view = memoryview(mapping)

    def read_at(self, offset: int, size: int) -> memoryview:
        """``size`` bytes at ``offset`` (fewer at the end of the file), without a copy."""
        return self._view[offset:offset + size]

    def checksum(self, algorithm: str, offset: int = 0, size: int | None = None) -> int:
        """The ``algorithm`` checksum of ``size`` bytes at ``offset`` (default: to the end)."""
        end = self.size if size is None else min(self.size, offset + size)
        return checksum(pa.py_buffer(self._view[offset:end]), algorithm)  # google-crc32c takes pyarrow buffers

    def close(self) -> None:
        """Unmap. A view still held elsewhere keeps the mapping until it is dropped."""
        mapping, self._map = self._map, None
        if mapping is None:
            return
        try:
            self._view.release()
            mapping.close()
        except BufferError:  # a view is still held; unmapped when it is collected
            logger.debug("%s stays mapped until its last view is dropped", self.path)


def map_file(path: str | Path) -> MappedFile | None:
    """``path`` mapped read-only; None when it cannot be (empty, missing, or a file system
    without ``mmap``): the caller reads it instead."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError) as exc:
        logger.debug("cannot map %s (%s): read instead", path, exc)
        return None
    finally:
        os.close(fd)
    return MappedFile(path, mapping)
