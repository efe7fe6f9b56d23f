"""Read-only view of one checkpoint directory for a restore: local files first, then
storage (:class:`TieredFs`).

Only the files DCP reads for this rank are touched, each checked once against the
manifest: a rank never reads (nor checksums) another rank's shard in the shared staging
directory. A node-local file is mapped (``_mmap``) and checked in the page cache
(another rank's: only the blocks this rank reads); a damaged one is read from storage
instead (``_storage_fetch``). Files fetched from storage are written to the node-local
copy in the background once the load is over, off the restore's path: a file of local
storage as a hard link when both are on one file system.
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from ray_goodput.checkpoint.restore import _byte_ranges
from ray_goodput.checkpoint.restore._mmap import MapGuard, MappedFile
from ray_goodput.checkpoint.restore._prefetch import Countdown, EarlyFetches
from ray_goodput.checkpoint.restore._storage_fetch import StorageFetch, _block_runs, _intact
from ray_goodput.storage import (
    FileEntry,
    RetryPolicy,
    StorageLocation,
    checksum,
    file_crc32,
    link_local_file,
    write_local_file,
)

logger = logging.getLogger(__name__)

_copiers: set[threading.Thread] = set()  # background writes into node-local copies, running
_copiers_lock = threading.Lock()


def wait_for_node_local_copies(timeout_s: float) -> bool:
    """Wait until the background work of finished loads (writes of restored files into
    node-local copies, unmapping) is done; False when some still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with _copiers_lock:
        running = list(_copiers)
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in running)


#: Bytes of files fetched from storage a rank holds in memory between their check and
#: DCP's read of them.
HOLD_BYTES = 2 << 30


class TieredFs(StorageFetch, FileSystemBase):
    """Read-only view of a checkpoint directory: local files first, then remote."""

    def __init__(
        self,
        remote: StorageLocation,
        local_dir: Path,
        local_names: set[str],
        entries: dict[str, FileEntry],
        policy: RetryPolicy,
        *,
        verified: bool = True,
        hold_bytes: int = HOLD_BYTES,
        guard: MapGuard | None = None,
    ):
        self.remote = remote
        self.local_dir = local_dir
        # ``verified``: the local names were checked already; else they are checked at first open.
        self.local_names = set(local_names) if verified else set()
        self.unchecked = set() if verified else set(local_names)
        self.entries = entries
        self.policy = policy
        self.ready: set[str] = set()
        self.held: dict[str, bytes] = {}  # checked bytes, served to DCP from memory
        self.mapped: dict[str, MappedFile] = {}  # checked local files, served from their mapping
        self.sparse: dict[str, _byte_ranges.Capture] = {}  # checked files of which only parts are kept
        self.hold_left = hold_bytes
        self.to_keep: list[str] = []  # held files that go into the node-local copy
        self.local_reads = 0
        self.remote_reads = 0
        self.remote_bytes = 0  # read from storage
        self.block_bytes_held = 0  # of the blocks kept in ``sparse``, charged to hold_left
        self.checked_blocks: dict[str, set[int]] = {}  # of node-local files checked by block
        self.partly_checked: set[str] = set()  # ready for this load's ranges only
        self.early = EarlyFetches()  # see fetch_early
        self.guard = guard or MapGuard(local_dir)  # ``guard``: of mappings made before (_local_guess)
        self._deferred: list[tuple[Any, tuple, str]] = []  # see release

    def _can_hold(self, want: FileEntry | None) -> bool:
        return want is not None and want.size <= self.hold_left

    def _hold(self, name: str, data: bytes) -> None:
        self.held[name] = data
        self.hold_left -= len(data)

    def release(self, *, defer: bool = False) -> None:
        """The load is over: write the fetched files into the node-local copy in the
        background (during the load, the writes compete with it for the CPU) and
        drop the held bytes. ``defer``: that background work (the copy, unmapping) starts
        only at :meth:`start_deferred`, once the restore's last collective is over (unmapping
        holds this process's memory map while the collective allocates)."""
        # The marker goes once nothing reads a mapping any more (no read can fail then):
        # after every early fetch still running (dropped: stopped, or ending soon) and
        # after the node-local copy when it copies from a mapping.
        readers = Countdown(self.guard.done)
        self.hold_left += self.early.drop(readers)
        self.ready.difference_update(self.held)  # opened again, they are fetched again
        self.ready.difference_update(self.mapped)
        keep = [(name, self.held.get(name), self.mapped.pop(name, None)) for name in self.to_keep]
        self.to_keep.clear()
        unmap = list(self.mapped.values())  # those in ``keep`` are closed once copied
        self.mapped.clear()
        copies_map = any(mapped is not None for _, _, mapped in keep)
        let_go = readers.hold() if copies_map else None
        readers.arm()
        if unmap:  # tearing down the page tables takes time: not on the load's path
            self._deferred.append((_unmap, (unmap,), "rg-restore-unmap"))
        self.ready.difference_update(self.sparse)
        self.ready.difference_update(self.partly_checked)
        self.partly_checked.clear()
        self.hold_left += sum(len(data) for data in self.held.values()) + self.block_bytes_held
        self.block_bytes_held = 0
        self.held.clear()
        self.sparse.clear()
        if keep:
            self._deferred.append((self._keep_local, (keep, let_go), "rg-node-local-copy"))
        if not defer:
            self.start_deferred()

    def start_deferred(self) -> None:
        """Start the background work :meth:`release` deferred (each piece once)."""
        work, self._deferred = self._deferred, []
        for target, args, name in work:
            _in_background(target, args, name)

    def _local_ok(self, name: str) -> bool:
        """Check a node-local file once, at its first open, against the manifest."""
        self.unchecked.discard(name)
        want = self.entries.get(name)
        if want is None:
            return False
        mapped = self.guard.map(self.local_dir / name)
        if mapped is not None:
            ok = _intact(mapped, want)
            if ok:
                self.mapped[name] = mapped
        else:
            try:  # not mappable here: a streamed check, then reads of the page-cached file
                ok = file_crc32(self.local_dir / name, want.algorithm) == (want.size, want.crc32)
            except OSError:
                ok = False
        if ok:
            self.local_names.add(name)
        return ok

    def _local_blocks_ok(self, name: str, runs: list[tuple[int, int]], want: FileEntry) -> bool:
        """Check only the blocks of a node-local file that hold the needed ranges (each
        block once): another rank's file on this node is not read whole."""
        done = self.checked_blocks.setdefault(name, set())
        size = want.block_bytes
        mapped = self.mapped.pop(name, None) or self.guard.map(self.local_dir / name)
        if mapped is not None:
            ok = mapped.size == want.size and all(
                mapped.checksum(want.algorithm, block * size, size) == want.blocks[block]
                for first, last in runs
                for block in range(first, last + 1)
                if block not in done
            )
            if ok:
                done.update(block for first, last in runs for block in range(first, last + 1))
                self.mapped[name] = mapped
            else:  # never served from: the blocks come from storage
                mapped.close()
            return ok
        try:
            with open(self.local_dir / name, "rb") as f:
                for first, last in runs:
                    for block in range(first, last + 1):
                        if block in done:
                            continue
                        f.seek(block * size)
                        data = f.read(min(size, want.size - block * size))
                        if (
                            len(data) != min(size, want.size - block * size)
                            or checksum(data, want.algorithm) != want.blocks[block]
                        ):
                            return False
                        done.add(block)
        except OSError:
            return False
        return True

    def _keep_local(self, files: list[tuple[str, bytes | None, MappedFile | None]], let_go: Any | None) -> None:
        """Write fetched (checked) files into the node-local copy, for the next restore: a
        mapped file of local storage as a hard link where it can be, else its bytes."""
        try:
            for name, data, mapped in files:
                try:
                    if mapped is None:
                        write_local_file(self.local_dir / name, data)
                    elif not _linked(mapped.path, self.local_dir / name):
                        write_local_file(self.local_dir / name, mapped.read_at(0, mapped.size))
                except OSError as exc:  # the copy only saves a later download
                    logger.warning("could not keep a node-local copy of %s in %s: %s", name, self.local_dir, exc)
                finally:
                    if mapped is not None:
                        mapped.close()
        finally:
            if let_go is not None:  # no more reads of a mapping
                let_go()

    def prepare(self, name: str, ranges: list[tuple[int, int]] | None = None) -> None:
        """Make ``name`` readable and checked, from memory or the local directory (once per
        file until :meth:`release`); ``ranges``: the only byte ranges that will be read."""
        if name in self.ready:
            return
        if self._take_early(name):
            self.ready.add(name)
            return
        want = self.entries.get(name)
        runs = _block_runs(want, ranges) if want is not None and ranges is not None else None
        if name in self.local_names:
            self.local_reads += 1
        elif name in self.unchecked and runs is not None and self._local_blocks_ok(name, runs, want):
            self.local_reads += 1
            self.partly_checked.add(name)  # checked for these ranges only: again at the next load
        elif name in self.unchecked and runs is None and self._local_ok(name):
            self.local_reads += 1
        else:
            self.unchecked.discard(name)  # a damaged local copy: storage from now on
            self.remote_reads += 1
            self._fetch(name, ranges)
        self.ready.add(name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[IO[bytes], None, None]:
        if "r" not in mode:
            raise PermissionError("checkpoint reader is read-only")
        name = str(path)
        self.prepare(name)
        data = self.held.get(name)
        if data is not None:
            yield io.BytesIO(data)
            return
        mapped = self.mapped.get(name)
        if mapped is not None:  # buffered: DCP unpickles .metadata from it in small reads
            with io.BufferedReader(_byte_ranges.ReadAtFile(mapped.read_at, mapped.size), 1 << 20) as f:
                yield f
            return
        parts = self.sparse.get(name)
        if parts is not None:
            yield _byte_ranges.ReadAtFile(parts.read_at, self.entries[name].size)
            return
        with open(self.local_dir / name, "rb") as f:
            yield f

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posixpath.join(str(path), suffix) if str(path) else suffix

    def init_path(self, path: str | os.PathLike) -> str:
        return ""  # names are relative to the checkpoint directory

    def rename(self, path: Any, new_path: Any) -> None:
        raise PermissionError("checkpoint reader is read-only")

    def mkdir(self, path: Any) -> None:
        raise PermissionError("checkpoint reader is read-only")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        name = str(path)
        if (
            name in self.held
            or name in self.mapped
            or name in self.sparse
            or name in self.local_names
            or name in self.unchecked
        ):
            return True
        return self.remote.fs.get_file_info(self.remote.join(name)).type.name != "NotFound"

    def rm_file(self, path: Any) -> None:
        raise PermissionError("checkpoint reader is read-only")


def _linked(stored: str, local: Path) -> bool:
    """Whether ``local`` is now a hard link of ``stored`` (False: copy the bytes instead,
    also when retention deleted the stored file since it was mapped)."""
    try:
        return link_local_file(stored, local)
    except FileNotFoundError:
        return False


def _in_background(target: Any, args: tuple, name: str) -> None:
    """Run ``target(*args)`` in a daemon thread that :func:`wait_for_node_local_copies` waits for."""

    def run() -> None:
        try:
            target(*args)
        finally:
            with _copiers_lock:
                _copiers.discard(threading.current_thread())

    thread = threading.Thread(target=run, daemon=True, name=name)
    with _copiers_lock:
        _copiers.add(thread)
    thread.start()


def _unmap(mappings: list[MappedFile]) -> None:
    for mapped in mappings:
        mapped.close()
