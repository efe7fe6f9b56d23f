"""A DCP StorageReader that reads each file from the node-local staged copy when that
copy matches the manifest, and otherwise from storage (retried, checked against the
manifest's size and checksum), keeping a node-local copy for the next restore.

Only the files DCP reads for this rank are touched, each checked once: a rank never reads
(nor checksums) another rank's shard in the shared staging directory. Every file of a
rank's read plan is checked, and every rank agrees that its files are intact, before DCP
copies anything into the live tensors: a damaged file fails the load with the state
untouched, not after another file was loaded in place.

A file from storage of which this rank needs only some ranges (another rank's data file,
for the few replicated records its owner wrote) is read only in the blocks of its
manifest entry that hold them, each block checked against its own checksum: a rank reads
O(its own shard), not every file of the checkpoint.

A local file (a node-local copy, or a file of a checkpoint in local storage) is mapped
(``_mapped``): checked in the page cache (another rank's: only the blocks this rank
reads), then whole tensors are copied from the mapping straight into the live ones
(``_direct_read``), the rest read by DCP from it. A file from local storage becomes the
node-local copy by a hard link when both are on one file system. Any other file that
comes from storage is read whole, in one request, checked in memory, and DCP reads it
from that buffer (up to ``hold_bytes`` per rank; beyond that files are downloaded to the
staging directory, then read from there). Fetched files are written to the node-local
copy in the background once the load is over, off the restore's path."""

from __future__ import annotations

import dataclasses
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

import pyarrow as pa
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ray_goodput.checkpoint import _collective, _direct_read, _sparse
from ray_goodput.checkpoint._early import Early, EarlyFetches, Found
from ray_goodput.checkpoint._mapped import MapGuard, MappedFile
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import (
    CHUNK_BYTES,
    CRC32,
    REMOTE_READ_BYTES,
    FileEntry,
    RetryPolicy,
    StorageLocation,
    checksum,
    copy_stream,
    download_file,
    file_crc32,
    link_local_file,
    read_bytes,
    write_local_file,
)

logger = logging.getLogger(__name__)

_copiers: set[threading.Thread] = set()  # background writes into node-local copies, running
_copiers_lock = threading.Lock()


def wait_for_node_local_copies(timeout_s: float) -> bool:
    """Wait until the background writes of restored files into node-local copies are done;
    False when some still run after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with _copiers_lock:
        running = list(_copiers)
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in running)


#: Bytes of files fetched from storage a rank holds in memory between their check and
#: DCP's read of them.
HOLD_BYTES = 2 << 30
#: A file from storage of which the rank needs at most a quarter (and that is this large)
#: is streamed past its checksum keeping only the needed ranges (``_sparse``): typically
#: another rank's data file, for the few replicated records its owner wrote.
SPARSE_MIN_BYTES = 64 << 20


class _TieredFs(FileSystemBase):
    """Read-only view of a checkpoint directory: local files first, then remote."""

    def __init__(self, remote: StorageLocation, local_dir: Path, local_names: set[str],
                 entries: dict[str, FileEntry], policy: RetryPolicy, *, verified: bool = True,
                 hold_bytes: int = HOLD_BYTES):
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
        self.sparse: dict[str, _sparse.Capture] = {}  # checked files of which only parts are kept
        self.hold_left = hold_bytes
        self.to_keep: list[str] = []  # held files that go into the node-local copy
        self.local_reads = 0
        self.remote_reads = 0
        self.remote_bytes = 0  # read from storage
        self.block_bytes_held = 0  # of the blocks kept in ``sparse``, charged to hold_left
        self.checked_blocks: dict[str, set[int]] = {}  # of node-local files checked by block
        self.partly_checked: set[str] = set()  # ready for this load's ranges only
        self.early = EarlyFetches()  # see fetch_early
        self.guard = MapGuard(local_dir)

    def _can_hold(self, want: FileEntry | None) -> bool:
        return want is not None and want.size <= self.hold_left

    def _hold(self, name: str, data: bytes) -> None:
        self.held[name] = data
        self.hold_left -= len(data)

    def release(self) -> None:
        """The load is over: write the fetched files into the node-local copy in the
        background (during the load, the writes slowed it down by ~80% on 2 cores) and
        drop the held bytes."""
        self.hold_left += self.early.drop()
        self.ready.difference_update(self.held)  # opened again, they are fetched again
        self.ready.difference_update(self.mapped)
        keep = [(name, self.held.get(name), self.mapped.pop(name, None)) for name in self.to_keep]
        self.to_keep.clear()
        for mapped in self.mapped.values():  # those in ``keep`` are closed once copied
            mapped.close()
        self.mapped.clear()
        copies_map = any(mapped is not None for _, _, mapped in keep)
        if not copies_map:
            self.guard.done()
        self.ready.difference_update(self.sparse)
        self.ready.difference_update(self.partly_checked)
        self.partly_checked.clear()
        self.hold_left += sum(len(data) for data in self.held.values()) + self.block_bytes_held
        self.block_bytes_held = 0
        self.held.clear()
        self.sparse.clear()
        if keep:
            copier = threading.Thread(target=self._keep_local, args=(keep, copies_map), daemon=True,
                                      name="rg-node-local-copy")
            with _copiers_lock:
                _copiers.add(copier)
            copier.start()

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
                for first, last in runs for block in range(first, last + 1) if block not in done)
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
                        if len(data) != min(size, want.size - block * size) \
                                or checksum(data, want.algorithm) != want.blocks[block]:
                            return False
                        done.add(block)
        except OSError:
            return False
        return True

    def _mismatch(self, name: str, size: int, crc: int, want: FileEntry) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{self.remote.uri}/{name}: {size} bytes {want.algorithm}={crc:#x}, manifest "
            f"says {want.size} bytes {want.algorithm}={want.crc32:#x}")

    def _fetch(self, name: str, ranges: list[tuple[int, int]] | None) -> None:
        want = self.entries.get(name)
        runs = _block_runs(want, ranges) if want is not None and ranges is not None else None
        if want is not None and self.remote.is_local and self._map_stored(name, runs, want, keep=not (
                ranges is not None and 2 * sum(length for _, length in ranges) <= want.size)):
            return
        if runs is not None and _runs_bytes(want, runs) <= self.hold_left:
            self._fetch_blocks(name, runs, want)
            return
        if want is not None and ranges is not None and want.size >= SPARSE_MIN_BYTES \
                and 4 * sum(length for _, length in ranges) <= want.size:
            self._fetch_parts(name, ranges, want)
            return
        if self._can_hold(want):
            data = self._read_checked(name, want)
            self.remote_bytes += len(data)
            self._hold(name, data)
            self.to_keep.append(name)
            return
        algorithm = want.algorithm if want is not None else CRC32
        got = download_file(self.remote, name, self.local_dir / name, self.policy, algorithm)
        self.remote_bytes += got.size
        if want is not None and (got.size, got.crc32) != (want.size, want.crc32):
            (self.local_dir / name).unlink(missing_ok=True)
            raise self._mismatch(name, got.size, got.crc32, want)
        self.local_names.add(name)

    def _map_stored(self, name: str, runs: list[tuple[int, int]] | None, want: FileEntry, *,
                    keep: bool) -> bool:
        """Map a file of local storage and check it (``runs``: only those blocks); False
        when it cannot be mapped. ``keep``: make it part of the node-local copy (not for a
        file of which this rank needs only a few ranges: its owner keeps its own)."""
        mapped = self._checked_stored_map(name, runs, want)
        if mapped is None:
            return False
        self.mapped[name] = mapped
        self.remote_bytes += mapped.size if runs is None else _runs_bytes(want, runs)
        if keep and runs is None:
            self.to_keep.append(name)
        return True

    def _checked_stored_map(self, name: str, runs: list[tuple[int, int]] | None,
                            want: FileEntry) -> MappedFile | None:
        """A file of local storage mapped and checked (``runs``: only those blocks); None
        when it cannot be mapped; CheckpointCorruptError when it is damaged."""
        mapped = self.guard.map(self.remote.join(name))
        if mapped is None:
            return None
        try:
            if mapped.size != want.size:
                raise CheckpointCorruptError(f"{self.remote.uri}/{name}: {mapped.size} bytes, "
                                             f"manifest says {want.size} bytes")
            for first, last in runs or ():
                for block in range(first, last + 1):
                    crc = mapped.checksum(want.algorithm, block * want.block_bytes, want.block_bytes)
                    if crc != want.blocks[block]:
                        raise CheckpointCorruptError(
                            f"{self.remote.uri}/{name}: block {block} has {want.algorithm}={crc:#x}, "
                            f"manifest says {want.blocks[block]:#x}")
            if runs is None:
                crc = mapped.checksum(want.algorithm)
                if crc != want.crc32:
                    raise self._mismatch(name, mapped.size, crc, want)
        except BaseException:
            mapped.close()
            raise
        return mapped

    def _read_checked(self, name: str, want: FileEntry) -> bytes:
        """The whole object, in one request, checked in memory."""
        data = read_bytes(self.remote, name, self.policy)
        crc = checksum(data, want.algorithm)
        if (len(data), crc) != (want.size, want.crc32):
            raise self._mismatch(name, len(data), crc, want)
        return data

    # ---- early fetches: a rank's own files, read while DCP plans ---------------------------

    def fetch_early(self, names: list[str]) -> None:
        """Start checking (or fetching) ``names``, files this rank will read whole, in the
        background (``_early``); :meth:`prepare` takes what was found when DCP asks."""
        for name in names:
            want = self.entries.get(name)
            if want is None or name in self.ready or name in self.early or name in self.local_names:
                continue
            hold = not self.remote.is_local and want.size <= self.hold_left
            self.hold_left -= want.size if hold else 0  # reserved until taken
            self.early.start(name, lambda n=name, w=want, l=name in self.unchecked, h=hold:
                             self._fetch_whole(n, w, l, h), want.size if hold else 0)

    def _fetch_whole(self, name: str, want: FileEntry, local: bool, hold: bool) -> Early | None:
        """The checked content of ``name``, found in the background: touches no state of
        this reader. None when :meth:`prepare` must take the file its own way."""
        if local:
            mapped = self.guard.map(self.local_dir / name)
            if mapped is None:
                return None  # not mappable: the streamed check
            if _intact(mapped, want):
                return Early(Found.LOCAL, mapped)
        if self.remote.is_local:
            mapped = self._checked_stored_map(name, None, want)
            if mapped is not None:
                return Early(Found.STORED, mapped)
        elif hold:
            return Early(Found.HELD, self._read_checked(name, want))
        return Early(Found.LOCAL_DAMAGED) if local else None

    def _take_early(self, name: str) -> bool:
        """Take the early fetch of ``name``, if one was started; False when ``prepare``
        must still make the file ready (its own way)."""
        if name not in self.early:
            return False
        self.hold_left += self.early.reserved(name)  # charged again below if it is held
        got = self.early.take(name, f"{self.remote.uri}/{name}")
        if got is None:
            return False
        self.unchecked.discard(name)  # checked now, or found damaged: storage from now on
        if got.found is Found.LOCAL_DAMAGED:
            return False
        if got.found is Found.LOCAL:
            self.local_reads += 1
            self.local_names.add(name)
        else:
            self.remote_reads += 1
            self.remote_bytes += len(got.content) if isinstance(got.content, bytes) else got.content.size
            self.to_keep.append(name)
        if isinstance(got.content, bytes):
            self._hold(name, got.content)
        else:
            self.mapped[name] = got.content
        return True

    def _fetch_parts(self, name: str, ranges: list[tuple[int, int]], want: FileEntry) -> None:
        """Stream the whole file past its checksum, keeping only ``ranges`` (not written
        to the node-local copy: the rank that owns the file keeps its own there)."""
        chunk = CHUNK_BYTES if self.remote.is_local else REMOTE_READ_BYTES

        def read() -> tuple[int, int, _sparse.Capture]:
            sink = _sparse.Capture(ranges)
            with self.remote.fs.open_input_file(self.remote.join(name)) as inp:
                size, crc = copy_stream(inp, sink, algorithm=want.algorithm, chunk_bytes=chunk)
            return size, crc, sink

        size, crc, sink = self.policy.call(f"read of {self.remote.uri}/{name}", read)
        self.remote_bytes += size
        if (size, crc) != (want.size, want.crc32):
            raise self._mismatch(name, size, crc, want)
        self.sparse[name] = sink

    def _fetch_blocks(self, name: str, runs: list[tuple[int, int]], want: FileEntry) -> None:
        """Read blocks ``first..last`` of each run (one ranged read per run) and check each
        block against its own checksum; keep them (not in the node-local copy: the rank
        that owns the file keeps its own there)."""
        size = want.block_bytes

        def read() -> tuple[int, list[tuple[int, bytes]]]:
            with self.remote.fs.open_input_file(self.remote.join(name)) as inp:
                actual = inp.size()
                if actual != want.size:  # cut short or grown: no ranged read past its end
                    return actual, []
                return actual, [(first * size, inp.read_at(min(want.size, (last + 1) * size) - first * size,
                                                           first * size)) for first, last in runs]

        actual, got = self.policy.call(f"read of blocks of {self.remote.uri}/{name}", read)
        if actual != want.size:
            raise CheckpointCorruptError(f"{self.remote.uri}/{name}: {actual} bytes, manifest says {want.size} bytes")
        for (_, data), (first, last) in zip(got, runs):
            self.remote_bytes += len(data)
            view = pa.py_buffer(data)  # slices without copies, which google-crc32c takes
            for block in range(first, last + 1):
                at, expected = (block - first) * size, min(size, want.size - block * size)
                piece = view.slice(at, expected) if at + expected <= len(data) else view.slice(min(at, len(data)))
                crc = checksum(piece, want.algorithm)
                if len(piece) != expected or crc != want.blocks[block]:
                    raise CheckpointCorruptError(
                        f"{self.remote.uri}/{name}: block {block} ({len(piece)} of {expected} bytes at "
                        f"{block * size}) has {want.algorithm}={crc:#x}, manifest says {want.blocks[block]:#x}")
        self.sparse[name] = _sparse.Capture.of(got)
        self.hold_left -= sum(len(data) for _, data in got)
        self.block_bytes_held += sum(len(data) for _, data in got)

    def _keep_local(self, files: list[tuple[str, bytes | None, MappedFile | None]], mapped_any: bool) -> None:
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
            if mapped_any:
                self.guard.done()
            with _copiers_lock:
                _copiers.discard(threading.current_thread())

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
            with io.BufferedReader(_sparse.ReadAtFile(mapped.read_at, mapped.size), 1 << 20) as f:
                yield f
            return
        parts = self.sparse.get(name)
        if parts is not None:
            yield _sparse.ReadAtFile(parts.read_at, self.entries[name].size)
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
        if name in self.held or name in self.mapped or name in self.sparse or name in self.local_names \
                or name in self.unchecked:
            return True
        return self.remote.fs.get_file_info(self.remote.join(name)).type.name != "NotFound"

    def rm_file(self, path: Any) -> None:
        raise PermissionError("checkpoint reader is read-only")


class TieredReader(FileSystemReader):
    """FileSystemReader over :class:`_TieredFs`."""

    def __init__(self, remote: StorageLocation, local_dir: Path, local_names: set[str],
                 entries: dict[str, FileEntry], policy: RetryPolicy, *, verified: bool = True,
                 hold_bytes: int = HOLD_BYTES):
        super().__init__(path="")
        self.fs = _TieredFs(remote, local_dir, local_names, entries, policy, verified=verified,
                            hold_bytes=hold_bytes)
        self.path = ""
        self._metadata: Metadata | None = None
        self.direct_tensors = 0  # tensors read straight into the live state

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Check (or fetch) every file of the plan, agree across ranks, then read whole
        tensors straight into the live ones and let DCP read the rest.

        Collective: DCP calls it on every rank in the same phase of ``dcp.load``."""
        error: BaseException | None = None
        ranges: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
        try:  # files fetched early last: the others' reads overlap them
            for name in sorted(ranges, key=lambda n: (n in self.fs.early, n)):
                self.fs.prepare(name, ranges[name])
        except Exception as exc:  # noqa: BLE001 - agreed below, before any rank copies
            error = exc
        _collective.agree(error)
        rest = self._read_direct(plan, planner)
        return super().read_data(dataclasses.replace(plan, items=rest), planner)

    def _read_direct(self, plan: LoadPlan, planner: LoadPlanner) -> list[ReadItem]:
        """Read the plan's whole-record tensors straight into their targets; returns the
        items left for DCP's own read (see ``_direct_read``)."""
        per_file: dict[str, list[ReadItem]] = {}
        rest: list[ReadItem] = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.TENSOR and not getattr(info, "transform_descriptors", None):
                per_file.setdefault(info.relative_path, []).append(item)
            else:
                rest.append(item)
        for name, items in per_file.items():
            held, parts, mapped = self.fs.held.get(name), self.fs.sparse.get(name), self.fs.mapped.get(name)
            if held is not None:
                rest += self._direct_items(items, planner, lambda at, n, b=memoryview(held): b[at:at + n])
            elif mapped is not None:
                rest += self._direct_items(items, planner, mapped.read_at)
            elif parts is not None:
                rest += self._direct_items(items, planner, parts.read_at)
            else:
                with open(self.fs.local_dir / name, "rb") as f:
                    rest += self._direct_items(items, planner, _reader_of(f), f)
        return rest

    def _direct_items(self, items: list[ReadItem], planner: LoadPlanner, read_at: Any,
                      f: Any = None) -> list[ReadItem]:
        """``read_at(offset, size)``: the file's bytes (from memory: a view, no copy); ``f``:
        the open file when it is read from disk (then read straight into the target)."""
        rest = []
        for item in items:
            info = self.storage_data[item.storage_index]
            target = planner.resolve_tensor(item).detach()
            if any(item.storage_offsets) or not _direct_read.can_take(target):
                rest.append(item)  # a slice of the record (resharding), or a GPU target
                continue
            try:
                record = _direct_read.parse_record(read_at, info.offset, info.length)
            except _direct_read.Unparsable:
                rest.append(item)
                continue
            if tuple(item.lengths) != record.size or not _direct_read.fits(record, target):
                rest.append(item)
                continue
            if f is None:
                _direct_read.fill_from_buffer(target, read_at(record.data_offset, record.nbytes), 0, record.nbytes)
            else:
                _direct_read.fill_from_file(target, f, record.data_offset, record.nbytes)
            planner.commit_tensor(item, target)
            self.direct_tensors += 1
        return rest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, read once (restore checks it before DCP reads it again)."""
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def release(self) -> None:
        """Drop the bytes held for DCP; call when the load is over."""
        self.fs.release()

    @property
    def local_reads(self) -> int:
        return self.fs.local_reads

    @property
    def remote_reads(self) -> int:
        return self.fs.remote_reads

    @property
    def remote_bytes(self) -> int:
        return self.fs.remote_bytes


def _intact(mapped: MappedFile, want: FileEntry) -> bool:
    """Whether a mapped file matches its manifest entry; closes it when it does not."""
    if (mapped.size, mapped.checksum(want.algorithm)) == (want.size, want.crc32):
        return True
    mapped.close()
    return False


def _linked(stored: str, local: Path) -> bool:
    """Whether ``local`` is now a hard link of ``stored`` (False: copy the bytes instead,
    also when retention deleted the stored file since it was mapped)."""
    try:
        return link_local_file(stored, local)
    except FileNotFoundError:
        return False


def _block_runs(want: FileEntry, ranges: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """Runs ``(first, last)`` of the blocks of ``want`` that hold ``ranges``; None when the
    entry has no block checksums or the blocks are over half the file (then one whole read
    is as good)."""
    if not want.blocks:
        return None
    size = want.block_bytes
    needed = sorted({b for offset, length in ranges if length > 0
                     for b in range(offset // size, (offset + length - 1) // size + 1)})
    runs: list[tuple[int, int]] = []
    for block in needed:
        if runs and runs[-1][1] == block - 1:
            runs[-1] = (runs[-1][0], block)
        else:
            runs.append((block, block))
    return runs if runs and 2 * _runs_bytes(want, runs) <= want.size else None


def _runs_bytes(want: FileEntry, runs: list[tuple[int, int]]) -> int:
    return sum(min(want.size, (last + 1) * want.block_bytes) - first * want.block_bytes for first, last in runs)


def _reader_of(f: Any) -> Any:
    def read_at(offset: int, size: int) -> bytes:
        f.seek(offset)
        return f.read(size)
    return read_at
