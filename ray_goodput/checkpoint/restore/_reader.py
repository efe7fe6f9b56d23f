"""A DCP StorageReader that reads each file from the node-local staged copy when that
copy matches the manifest, and otherwise from storage (retried, checked against the
manifest's size and checksum), keeping a node-local copy for the next restore
(:class:`~ray_goodput.checkpoint.restore._tiered_fs.TieredFs`, ``_storage_fetch``).

Every file of a rank's read plan is checked, and every rank agrees that its files are
intact, before anything is copied into the live tensors: a damaged file fails the load
with the state untouched, not after another file was loaded in place. Whole tensors are
then copied straight into the live ones (``_direct_read``) from the file's mapping, the
held buffer or the kept blocks; the rest are read by DCP.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ray_goodput.checkpoint.protocol import _collective
from ray_goodput.checkpoint.restore import _direct_read
from ray_goodput.checkpoint.restore._mmap import MapGuard
from ray_goodput.checkpoint.restore._storage_fetch import SPARSE_MIN_BYTES
from ray_goodput.checkpoint.restore._tiered_fs import HOLD_BYTES, TieredFs, wait_for_node_local_copies
from ray_goodput.storage import FileEntry, RetryPolicy, StorageLocation

_TieredFs = TieredFs  # the name tests and tools know it by

__all__ = ["HOLD_BYTES", "SPARSE_MIN_BYTES", "TieredReader", "wait_for_node_local_copies"]


class TieredReader(FileSystemReader):
    """FileSystemReader over :class:`TieredFs`."""

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
        super().__init__(path="")
        self.fs = TieredFs(
            remote, local_dir, local_names, entries, policy, verified=verified, hold_bytes=hold_bytes, guard=guard
        )
        self.path = ""
        self._metadata: Metadata | None = None
        self.direct_tensors = 0  # tensors read straight into the live state
        self.read_agreed = False  # read_data's agreement reached (see read_data)
        self.agreed_error: Exception | None = None  # what that agreement raised
        self.released = False  # release() was called

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Check (or fetch) every file of the plan, agree across ranks, then read whole
        tensors straight into the live ones and let DCP read the rest.

        Collective: the load's one agreement across ranks (``read_agreed`` tells whether
        this rank reached it; a rank that failed before it must join it with its error)."""
        error: BaseException | None = None
        self.read_agreed = True
        try:
            ranges: dict[str, list[tuple[int, int]]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
            # files fetched early last: the others' reads overlap them
            for name in sorted(ranges, key=lambda n: (n in self.fs.early, n)):
                self.fs.prepare(name, ranges[name])
        except Exception as exc:  # noqa: BLE001 - agreed below, before any rank copies
            error = exc
        try:
            _collective.agree(error)
        except Exception as exc:
            self.agreed_error = exc  # the failing rank's own, not DCP's wrapping of it
            raise
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
                rest += self._direct_items(items, planner, functools.partial(_slice, memoryview(held)))
            elif mapped is not None:
                rest += self._direct_items(items, planner, mapped.read_at)
            elif parts is not None:
                rest += self._direct_items(items, planner, parts.read_at)
            else:
                with open(self.fs.local_dir / name, "rb") as f:
                    rest += self._direct_items(items, planner, _reader_of(f), f)
        return rest

    def _direct_items(self, items: list[ReadItem], planner: LoadPlanner, read_at: Any, f: Any = None) -> list[ReadItem]:
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

    def release(self, *, defer: bool = False) -> None:
        """Drop the bytes held for DCP; call when the load is over (``defer``: see
        :meth:`TieredFs.release`)."""
        self.fs.release(defer=defer)
        self.released = True

    def start_deferred(self) -> None:
        self.fs.start_deferred()

    @property
    def local_reads(self) -> int:
        return self.fs.local_reads

    @property
    def remote_reads(self) -> int:
        return self.fs.remote_reads

    @property
    def remote_bytes(self) -> int:
        return self.fs.remote_bytes


def _reader_of(f: Any) -> Any:
    def read_at(offset: int, size: int) -> bytes:
        f.seek(offset)
        return f.read(size)

    return read_at


def _slice(view: memoryview, at: int, n: int) -> memoryview:
    return view[at : at + n]
