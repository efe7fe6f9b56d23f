"""A DCP StorageReader that reads each file from the node-local staged copy when that
copy matches the manifest, and otherwise first downloads it there (parallel-safe,
atomic, retried, checked against the manifest's size and CRC32)."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import FileEntry, RetryPolicy, StorageLocation, download_file


class _TieredFs(FileSystemBase):
    """Read-only view of a checkpoint directory: local files first, then remote."""

    def __init__(self, remote: StorageLocation, local_dir: Path, local_names: set[str],
                 entries: dict[str, FileEntry], policy: RetryPolicy):
        self.remote = remote
        self.local_dir = local_dir
        self.local_names = set(local_names)
        self.entries = entries
        self.policy = policy
        self.local_reads = 0
        self.remote_reads = 0

    def _fetch(self, name: str) -> None:
        got = download_file(self.remote, name, self.local_dir / name, self.policy)
        want = self.entries.get(name)
        if want is not None and (got.size, got.crc32) != (want.size, want.crc32):
            (self.local_dir / name).unlink(missing_ok=True)
            raise CheckpointCorruptError(
                f"{self.remote.uri}/{name}: {got.size} bytes crc32={got.crc32:#x}, manifest "
                f"says {want.size} bytes crc32={want.crc32:#x}")
        self.local_names.add(name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[IO[bytes], None, None]:
        if "r" not in mode:
            raise PermissionError("checkpoint reader is read-only")
        name = str(path)
        if name in self.local_names:
            self.local_reads += 1
        else:
            self.remote_reads += 1
            self._fetch(name)
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
        if name in self.local_names:
            return True
        return self.remote.fs.get_file_info(self.remote.join(name)).type.name != "NotFound"

    def rm_file(self, path: Any) -> None:
        raise PermissionError("checkpoint reader is read-only")


class TieredReader(FileSystemReader):
    """FileSystemReader over :class:`_TieredFs`."""

    def __init__(self, remote: StorageLocation, local_dir: Path, local_names: set[str],
                 entries: dict[str, FileEntry], policy: RetryPolicy):
        super().__init__(path="")
        self.fs = _TieredFs(remote, local_dir, local_names, entries, policy)
        self.path = ""
        self._metadata: Metadata | None = None

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
