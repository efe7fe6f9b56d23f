"""A DCP StorageReader that reads each file from the node-local staged copy when that
copy matches the manifest, and straight from remote storage otherwise (ranged reads,
no full download)."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader

from ray_goodput.storage import StorageLocation


class _TieredFs(FileSystemBase):
    """Read-only view of a checkpoint directory: local files first, then remote."""

    def __init__(self, remote: StorageLocation, local_dir: Path | None, local_names: set[str]):
        self.remote = remote
        self.local_dir = local_dir
        self.local_names = local_names
        self.local_reads = 0
        self.remote_reads = 0

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[IO[bytes], None, None]:
        if "r" not in mode:
            raise PermissionError("checkpoint reader is read-only")
        name = str(path)
        if self.local_dir is not None and name in self.local_names:
            self.local_reads += 1
            with open(self.local_dir / name, "rb") as f:
                yield f
            return
        self.remote_reads += 1
        with self.remote.fs.open_input_file(self.remote.join(name)) as f:
            yield f  # pyarrow files support seek/tell/read, which DCP's file views need

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
        if self.local_dir is not None and name in self.local_names:
            return True
        return self.remote.fs.get_file_info(self.remote.join(name)).type.name != "NotFound"

    def rm_file(self, path: Any) -> None:
        raise PermissionError("checkpoint reader is read-only")


class TieredReader(FileSystemReader):
    """FileSystemReader over :class:`_TieredFs`."""

    def __init__(self, remote: StorageLocation, local_dir: Path | None, local_names: set[str]):
        super().__init__(path="")
        self.fs = _TieredFs(remote, local_dir, local_names)
        self.path = ""

    @property
    def local_reads(self) -> int:
        return self.fs.local_reads

    @property
    def remote_reads(self) -> int:
        return self.fs.remote_reads
