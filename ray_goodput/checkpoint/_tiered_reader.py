"""A DCP StorageReader that reads each file from the node-local staged copy when that
copy matches the manifest, and otherwise first downloads it there (parallel-safe,
atomic, retried, checked against the manifest's size and checksum).

Only the files DCP reads for this rank are touched, each checked once: a rank never reads
(nor checksums) another rank's shard in the shared staging directory. Every file of a
rank's read plan is checked, and every rank agrees that its files are intact, before DCP
copies anything into the live tensors: a damaged file fails the load with the state
untouched, not after another file was loaded in place."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ray_goodput.checkpoint import _collective
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import CRC32, FileEntry, RetryPolicy, StorageLocation, download_file, file_crc32


class _TieredFs(FileSystemBase):
    """Read-only view of a checkpoint directory: local files first, then remote."""

    def __init__(self, remote: StorageLocation, local_dir: Path, local_names: set[str],
                 entries: dict[str, FileEntry], policy: RetryPolicy, *, verified: bool = True):
        self.remote = remote
        self.local_dir = local_dir
        # ``verified``: the local names were checked already; else they are checked at first open.
        self.local_names = set(local_names) if verified else set()
        self.unchecked = set() if verified else set(local_names)
        self.entries = entries
        self.policy = policy
        self.ready: set[str] = set()
        self.local_reads = 0
        self.remote_reads = 0

    def _local_ok(self, name: str) -> bool:
        """Check a node-local file once, at its first open, against the manifest."""
        self.unchecked.discard(name)
        want = self.entries.get(name)
        try:
            ok = want is not None and \
                file_crc32(self.local_dir / name, want.algorithm) == (want.size, want.crc32)
        except OSError:
            ok = False
        if ok:
            self.local_names.add(name)
        return ok

    def _fetch(self, name: str) -> None:
        want = self.entries.get(name)
        algorithm = want.algorithm if want is not None else CRC32
        got = download_file(self.remote, name, self.local_dir / name, self.policy, algorithm)
        if want is not None and (got.size, got.crc32) != (want.size, want.crc32):
            (self.local_dir / name).unlink(missing_ok=True)
            raise CheckpointCorruptError(
                f"{self.remote.uri}/{name}: {got.size} bytes {got.algorithm}={got.crc32:#x}, manifest "
                f"says {want.size} bytes {want.algorithm}={want.crc32:#x}")
        self.local_names.add(name)

    def prepare(self, name: str) -> None:
        """Make ``name`` readable, checked, from the local directory (once per file)."""
        if name in self.ready:
            return
        if name in self.local_names or (name in self.unchecked and self._local_ok(name)):
            self.local_reads += 1
        else:
            self.remote_reads += 1
            self._fetch(name)
        self.ready.add(name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[IO[bytes], None, None]:
        if "r" not in mode:
            raise PermissionError("checkpoint reader is read-only")
        self.prepare(str(path))
        with open(self.local_dir / str(path), "rb") as f:
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
        if name in self.local_names or name in self.unchecked:
            return True
        return self.remote.fs.get_file_info(self.remote.join(name)).type.name != "NotFound"

    def rm_file(self, path: Any) -> None:
        raise PermissionError("checkpoint reader is read-only")


class TieredReader(FileSystemReader):
    """FileSystemReader over :class:`_TieredFs`."""

    def __init__(self, remote: StorageLocation, local_dir: Path, local_names: set[str],
                 entries: dict[str, FileEntry], policy: RetryPolicy, *, verified: bool = True):
        super().__init__(path="")
        self.fs = _TieredFs(remote, local_dir, local_names, entries, policy, verified=verified)
        self.path = ""
        self._metadata: Metadata | None = None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Check (or fetch) every file of the plan, agree across ranks, then let DCP copy.

        Collective: DCP calls it on every rank in the same phase of ``dcp.load``."""
        error: BaseException | None = None
        try:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                self.fs.prepare(name)
        except Exception as exc:  # noqa: BLE001 - agreed below, before any rank copies
            error = exc
        _collective.agree(error)
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, read once (restore checks it before DCP reads it again)."""
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    @property
    def local_reads(self) -> int:
        return self.fs.local_reads

    @property
    def remote_reads(self) -> int:
        return self.fs.remote_reads
