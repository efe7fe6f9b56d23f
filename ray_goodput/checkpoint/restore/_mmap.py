"""Read-only memory maps of checkpoint files on a local file system, for restore.

A restore reads a local file (the node-local copy, or a file of a checkpoint in local
storage), checks it, then copies its tensors into the live state. Read into a new buffer,
that is three passes over the bytes plus a page fault per 4 KiB of the new buffer: at
1 GiB the faults cost more than the read. Mapped, the checksum runs over the page cache
itself and the tensors are copied straight from it: faster than a plain read into a new
buffer (docs/design/restore.md has the measurement).

The bytes of a mapped file are those of the page cache, so they must not change between
the check and the copy: checkpoint files are written once (aside, then renamed into
place), never rewritten in place, and on a local disk a file deleted while mapped stays
readable until unmapped. What a mapping cannot do is report a failed read: a disk error,
a file cut short by something else, or a file of shared storage deleted from another
node (a stale NFS handle) ends the reading process with SIGBUS instead of an OSError the
reader could fall back from. So a restore that maps files leaves a marker with its pid in
the node-local directory until it is done (:class:`MapGuard`); a marker of a process
that is gone means a restore may have died that way, and later restores of that step
read the files instead of mapping them (and fall back to storage on an error) rather
than dying again at the same place. Files that cannot be mapped (empty, or on a file
system without ``mmap``) are read as before.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from pathlib import Path

import psutil
import pyarrow as pa

from ray_goodput.runtime._process import pid_alive
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
        return self._view[offset : offset + size]

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


_MARKER = ".mapping-"


class MapGuard:
    """Whether files may be mapped for a restore whose node-local directory is
    ``directory``, and this process's marker there while it maps them."""

    def __init__(self, directory: Path) -> None:
        self._marker = directory / f"{_MARKER}{os.getpid()}"
        self._marked = False
        self._lock = threading.Lock()  # map() from fetch threads, done() from the load's
        dead = [p.name for p in _markers(directory) if _left_by_the_dead(p)]
        self.allowed = not dead
        if dead:
            logger.warning(
                "a restore in process %s ended while it had files of %s mapped; reading them "
                "instead of mapping (a failed read is then an error to fall back from)",
                ", ".join(n[len(_MARKER) :] for n in dead),
                directory,
            )

    def map(self, path: str | Path) -> MappedFile | None:
        """:func:`map_file`, with this process marked first; None when mapping is off."""
        with self._lock:  # a done() between the check and the marker would leave it behind
            if not self.allowed:
                return None
            if not self._marked:
                try:
                    self._marker.parent.mkdir(parents=True, exist_ok=True)
                    self._marker.touch()
                except OSError:  # no marker, no mapping: the guard must be able to see a death
                    self.allowed = False
                    return None
                self._marked = True
        return map_file(path)

    def done(self) -> None:
        """Every mapping of this load is closed: no more are made (a fetch still running
        in the background reads instead), and the marker goes."""
        with self._lock:
            self.allowed = False
            if self._marked:
                self._marker.unlink(missing_ok=True)
                self._marked = False


def _left_by_the_dead(marker: Path) -> bool:
    """Whether the process that wrote ``marker`` is gone. Its pid alone does not say: a
    container restarted on the same host path reuses pids, this process's included. For
    this process's pid: a marker older than this process is a dead one's. For another pid:
    ``pid_alive`` with the marker's time as ``since``, which takes a process that started
    more than a minute after the marker for a later one (a death and a restart within that
    minute still look alive)."""
    try:
        written = marker.stat().st_mtime
    except OSError:  # removed meanwhile: its restore ended
        return False
    pid = int(marker.name[len(_MARKER) :])
    if pid == os.getpid():
        return written < psutil.Process().create_time()
    return not pid_alive(pid, since=written)


def _markers(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.glob(f"{_MARKER}*") if p.name[len(_MARKER) :].isdigit()]
    except OSError:
        return []


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
