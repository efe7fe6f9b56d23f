"""DCP storage plugins over any ``pyarrow.fs`` URI, for users who call DCP themselves.

    dcp.save(state, storage_writer=PyArrowStorageWriter("s3://bucket/ckpt/step-10"))
    dcp.load(state, storage_reader=PyArrowStorageReader("s3://bucket/ckpt/step-10"))

Design: DCP's own ``FileSystemWriter``/``FileSystemReader`` do all the planning, file
layout and (de)serialization through a small ``FileSystemBase`` interface; we give them
one that talks to ``pyarrow.fs`` (the same thing DCP's fsspec plugins do for fsspec).
The files written are byte-for-byte what DCP writes to a local directory, so a checkpoint
written here reads with stock DCP after a plain copy, and the reverse.

Object stores have no rename: DCP writes ``.metadata`` under a temporary name and then
renames it, which ``pyarrow.fs`` turns into copy + delete. ``.metadata`` is still the
last file written, so a reader never sees a half-written checkpoint as complete.

Reads from a remote filesystem fetch each needed file whole into memory (one GET
instead of one ranged GET per tensor, which is what torch's zip reader would issue);
a rank that reads a slice of a large file after resharding downloads all of it.
"""

from __future__ import annotations

import io
import os
import posixpath
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import pyarrow.fs as pafs
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

from ray_goodput.errors import ConfigError
from ray_goodput.storage import RetryPolicy, StorageLocation, resolve

__all__ = ["PyArrowStorageReader", "PyArrowStorageWriter"]


class _PyArrowFileSystem(FileSystemBase):
    """DCP's filesystem interface over one ``pyarrow.fs`` filesystem.

    Paths handed to DCP are paths inside that filesystem (no scheme); ``init_path``
    takes a URI (it is also what ``reset(checkpoint_id)`` passes).
    """

    def __init__(self, retry: RetryPolicy | None = None) -> None:
        self.fs: pafs.FileSystem | None = None
        self.local = False
        self.retry = retry or RetryPolicy()

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str:
        loc = _location(path)
        self.fs, self.local = loc.fs, loc.is_local
        return loc.root

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if mode == "rb":
            yield self._open_read(path)
        elif mode == "wb":
            with self.fs.open_output_stream(path) as out:
                yield out
        else:
            raise ValueError(f"unsupported stream mode {mode!r} (DCP uses 'rb' and 'wb')")

    def _open_read(self, path: str) -> io.IOBase:
        if self.local:
            return open(path, "rb")  # closed by DCP's `with`
        # One whole-object GET, retried: DCP seeks around inside it afterwards.
        return io.BytesIO(self.retry.call(f"read of {path}", lambda: _read_all(self.fs, path)))

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.fs.move(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike) -> None:
        self.fs.create_dir(os.fspath(path), recursive=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _location(checkpoint_id)
        except ConfigError:
            return False
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.fs.get_file_info(os.fspath(path)).type != pafs.FileType.NotFound

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.delete_file(os.fspath(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        selector = pafs.FileSelector(os.fspath(path), allow_not_found=True)
        return [info.path for info in self.fs.get_file_info(selector)]


def _read_all(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_file(path) as inp:
        return inp.read()


def _location(uri: str | os.PathLike | StorageLocation) -> StorageLocation:
    return uri if isinstance(uri, StorageLocation) else resolve(os.fspath(uri))


class _OnPyArrow:
    """What both plugins share: DCP's file-system plugin pointed at a pyarrow.fs URI."""

    def _attach(self, uri: str | StorageLocation, retry: RetryPolicy | None) -> None:
        self.fs = _PyArrowFileSystem(retry)
        self.path = self.fs.init_path(uri)
        self.uri = _location(uri).uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _PyArrowFileSystem.validate_checkpoint_id(checkpoint_id)


class PyArrowStorageWriter(_OnPyArrow, FileSystemWriter):
    """A DCP ``StorageWriter`` that writes a checkpoint to ``uri`` (any ``pyarrow.fs`` URI).

    Use it with ``dcp.save`` and ``dcp.async_save`` (it stages like
    ``FileSystemWriter``: a CPU copy, then the write in DCP's background thread).
    ``sync_files`` is off by default: object stores have no fsync, and on a local
    disk it is the same trade-off as DCP's option.
    """

    def __init__(
        self,
        uri: str | StorageLocation,
        *,
        thread_count: int = 1,
        sync_files: bool = False,
        overwrite: bool = True,
        retry: RetryPolicy | None = None,
    ) -> None:
        if thread_count != 1:
            # DCP's extra writer threads drop their exceptions: a failed upload (on S3 it
            # surfaces when the stream closes) would still get a .metadata that names it.
            raise ConfigError(
                f"PyArrowStorageWriter(thread_count={thread_count}) would lose the errors "
                "of DCP's writer threads; use thread_count=1 (the default)"
            )
        super().__init__(os.getcwd(), sync_files=sync_files, thread_count=thread_count, overwrite=overwrite)
        self._attach(uri, retry)


class PyArrowStorageReader(_OnPyArrow, FileSystemReader):
    """A DCP ``StorageReader`` for a checkpoint at ``uri`` (any ``pyarrow.fs`` URI).

    Reads ``.metadata`` and the files this rank needs; each remote file is fetched
    whole (retried) into memory.
    """

    def __init__(self, uri: str | StorageLocation, *, retry: RetryPolicy | None = None) -> None:
        super().__init__(os.getcwd())
        self._attach(uri, retry)
