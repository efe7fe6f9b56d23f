"""File transfers between local disk and a StorageLocation: parallel, retried, checksummed."""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.fs as pafs

from ray_goodput.errors import StorageError
from ray_goodput.storage import _checksum
from ray_goodput.storage._checksum import CHUNK_BYTES, CRC32, REMOTE_READ_BYTES, copy_stream, file_crc32
from ray_goodput.storage._durable import fsync_dir, fsync_file
from ray_goodput.storage._retry import RetryPolicy
from ray_goodput.storage._uri import StorageLocation
from ray_goodput.storage._written import Written

logger = logging.getLogger(__name__)

DEFAULT_POLICY = RetryPolicy()
T = TypeVar("T")
_DIR_ATTEMPTS = 3  # a directory removed between our mkdir and our write, more than once
_LIST_RACE_ATTEMPTS = 10  # a directory created between pyarrow's listing and its existence check


@dataclass(frozen=True)
class FileEntry:
    """A file of a checkpoint: path relative to its directory, size in bytes, checksum.

    ``crc32`` holds the checksum computed with ``algorithm`` (the field name predates
    CRC32C; records without an algorithm are CRC32). ``blocks``: the checksum of each
    ``block_bytes`` block (the last one shorter), so that a range can be checked without
    reading the whole file; empty in records written before they existed."""

    name: str
    size: int
    crc32: int
    algorithm: str = CRC32
    block_bytes: int = 0
    blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.blocks and (self.block_bytes < 1 or len(self.blocks) != -(-self.size // self.block_bytes)):
            raise ValueError(
                f"{self.name}: {self.size} bytes in blocks of {self.block_bytes} need "
                f"{-(-self.size // max(1, self.block_bytes))} block checksums, got {len(self.blocks)}"
            )

    def to_json(self) -> dict:
        out: dict = {"name": self.name, "size": self.size, "crc32": self.crc32}
        if self.algorithm != CRC32:
            out["checksum"] = self.algorithm
        if self.blocks:
            out["block_bytes"] = self.block_bytes
            out["blocks"] = list(self.blocks)
        return out

    @staticmethod
    def from_json(d: dict, default_algorithm: str = CRC32) -> FileEntry:
        return FileEntry(
            name=str(d["name"]),
            size=int(d["size"]),
            crc32=int(d["crc32"]),
            algorithm=str(d.get("checksum", default_algorithm)),
            block_bytes=int(d.get("block_bytes", 0)),
            blocks=tuple(int(b) for b in d.get("blocks", ())),
        )


def _copy_up(
    local: Path, fs: pafs.FileSystem, dest: str, algorithm: str, blocks: list[int], block_bytes: int
) -> tuple[int, int]:
    blocks.clear()  # a retried copy starts over
    with open(local, "rb") as src, fs.open_output_stream(dest) as out:
        return copy_stream(src, out, algorithm=algorithm, blocks=blocks, block_bytes=block_bytes)


def _copy_aside(
    local: Path, fs: pafs.FileSystem, dest: str, algorithm: str, blocks: list[int], block_bytes: int
) -> tuple[int, int]:
    """:func:`_copy_up` on a file system: written aside, then renamed into place, so that
    a file already there (a retried or replayed upload) is replaced, never rewritten
    while a restore may have it mapped (``checkpoint/_mapped``)."""
    tmp = f"{dest}.part-{os.getpid()}-{threading.get_ident()}"
    try:
        got = _copy_up(local, fs, tmp, algorithm, blocks, block_bytes)
        fsync_file(tmp)  # before the rename: a crash must not leave the final name short
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return got


#: What ``os.link`` raises where the two paths are on different file systems or the file
#: system has no hard links.
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP)


def _linked(src: str | Path, link: str | Path) -> bool:
    """Hard-link ``src`` as ``link``; False when the file systems differ or links are not
    supported there."""
    try:
        os.link(src, link)
    except OSError as exc:
        if exc.errno in _NO_LINK:
            return False
        raise
    return True


def _link_up(
    local: Path, dest: str, algorithm: str, blocks: list[int], block_bytes: int, known: Written | None
) -> tuple[int, int] | None:
    """Hard-link ``local`` as ``dest`` (same file system): the bytes are not written a
    second time. None when the file systems differ or links are not supported there.
    ``known``: the file's checksums as it was written (else it is read back)."""
    tmp = f"{dest}.link-{os.getpid()}-{threading.get_ident()}"
    if not _linked(local, tmp):
        return None
    try:
        blocks.clear()
        if (
            known is not None
            and (known.algorithm, known.block_bytes) == (algorithm, block_bytes)
            and os.stat(tmp).st_size == known.size
        ):
            size, crc = known.size, known.crc32
            blocks.extend(known.blocks)
        else:
            size, crc = file_crc32(tmp, algorithm, blocks=blocks, block_bytes=block_bytes)  # page cache
        fsync_file(tmp)  # before the rename: a crash must not leave the final name short
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return size, crc


def upload_file(
    local: str | Path,
    loc: StorageLocation,
    name: str,
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    algorithm: str = CRC32,
    link: bool = False,
    known: Written | None = None,
) -> FileEntry:
    """Upload ``local`` to ``<loc>/<name>``; retried; returns size and checksum (``algorithm``)
    of what was sent.

    On a file system the file and its directory are fsynced before this returns. With
    ``link`` (the caller never writes ``local`` again: it replaces or deletes it) and
    ``local`` on the same file system, the upload is a hard link instead of a copy, and
    ``known`` (its checksums as it was written, see ``ChecksummedWrite``) spares reading
    it back."""
    dest = loc.join(name)
    parent = posixpath.dirname(dest)
    blocks: list[int] = []
    block_bytes = _checksum.upload_block_bytes(_size(local))
    if known is not None and known.algorithm == algorithm:
        block_bytes = known.block_bytes  # the writer's, from a size hint: its sums stay usable

    def _send() -> tuple[int, int]:
        if not loc.is_local:
            return _copy_up(Path(local), loc.fs, dest, algorithm, blocks, block_bytes)
        return _into_dir(
            loc,
            parent,
            lambda: (
                (_link_up(Path(local), dest, algorithm, blocks, block_bytes, known) if link else None)
                or _copy_aside(Path(local), loc.fs, dest, algorithm, blocks, block_bytes)
            ),
        )

    size, crc = policy.call(f"upload of {local} to {loc.uri}/{name}", _send)
    if loc.is_local:
        fsync_dir(parent)  # the rename (the file was fsynced before it)
    return FileEntry(
        name=name,
        size=size,
        crc32=crc,
        algorithm=algorithm,
        block_bytes=block_bytes if blocks else 0,
        blocks=tuple(blocks),
    )


def _size(local: str | Path) -> int:
    try:
        return os.stat(local).st_size
    except OSError:
        return 0  # the upload reports it


def upload_files(
    files: Sequence[tuple[str | Path, str]],
    loc: StorageLocation,
    *,
    concurrency: int = 8,
    policy: RetryPolicy = DEFAULT_POLICY,
    algorithm: str = CRC32,
    link: bool = False,
    known: Mapping[str, Written] | None = None,
) -> list[FileEntry]:
    """Upload ``(local_path, name)`` pairs with up to ``concurrency`` parallel streams
    (``link``, ``known`` by name: see :func:`upload_file`)."""
    if not files:
        return []
    known = known or {}
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(files))), thread_name_prefix="rg-upload") as pool:
        futures = [
            pool.submit(upload_file, path, loc, name, policy, algorithm=algorithm, link=link, known=known.get(name))
            for path, name in files
        ]
        return [f.result() for f in futures]


def _copy_down(fs: pafs.FileSystem, src: str, local: Path, algorithm: str, chunk_bytes: int) -> tuple[int, int]:
    tmp = _part_name(local)
    try:
        with fs.open_input_file(src) as inp, open(tmp, "wb") as out:
            size, crc = copy_stream(inp, out, algorithm=algorithm, chunk_bytes=chunk_bytes)
        os.replace(tmp, local)  # the final name appears only with complete content
    finally:
        tmp.unlink(missing_ok=True)
    return size, crc


def _part_name(local: Path) -> Path:
    return local.with_name(f".{local.name}.part-{os.getpid()}-{threading.get_ident()}")


def write_local_file(local: str | Path, data: bytes) -> None:
    """Write ``data`` to ``local`` atomically (temp name + rename; not fsynced: a node-local
    copy that a reader checks against its manifest before use)."""
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = _part_name(local)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def link_local_file(src: str | Path, local: str | Path) -> bool:
    """Make ``local`` a hard link of ``src`` atomically (temp name + rename): the same bytes
    under a second name, none written. False when the two are on different file systems or
    links are not supported there (nothing is created then)."""
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = _part_name(local)
    if not _linked(src, tmp):
        return False
    try:
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def object_crc32(
    loc: StorageLocation, name: str, policy: RetryPolicy = DEFAULT_POLICY, algorithm: str = CRC32
) -> tuple[int, int]:
    """``(size, checksum)`` of ``<loc>/<name>``, read in full from storage; retried."""

    def _read() -> tuple[int, int]:
        with loc.fs.open_input_file(loc.join(name)) as inp:
            return copy_stream(inp, algorithm=algorithm)

    return policy.call(f"checksum of {loc.uri}/{name}", _read)


def download_file(
    loc: StorageLocation, name: str, local: str | Path, policy: RetryPolicy = DEFAULT_POLICY, algorithm: str = CRC32
) -> FileEntry:
    """Download ``<loc>/<name>`` to ``local`` atomically (temp name + rename); retried;
    checksummed with ``algorithm`` on the way."""
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    chunk = CHUNK_BYTES if loc.is_local else REMOTE_READ_BYTES
    size, crc = policy.call(
        f"download of {loc.uri}/{name}", lambda: _copy_down(loc.fs, loc.join(name), local, algorithm, chunk)
    )
    return FileEntry(name=name, size=size, crc32=crc, algorithm=algorithm)


def download_files(
    names: Iterable[str],
    loc: StorageLocation,
    local_dir: str | Path,
    *,
    concurrency: int = 8,
    policy: RetryPolicy = DEFAULT_POLICY,
) -> list[FileEntry]:
    """Download ``names`` under ``loc`` into ``local_dir`` with parallel streams."""
    names = list(names)
    if not names:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(names))), thread_name_prefix="rg-download") as pool:
        futures = [pool.submit(download_file, loc, n, Path(local_dir) / n, policy) for n in names]
        return [f.result() for f in futures]


def write_bytes(loc: StorageLocation, name: str, data: bytes, policy: RetryPolicy = DEFAULT_POLICY) -> None:
    """Write a small object in one request; retried. On a file system it is written
    aside, fsynced, renamed into place and its directory fsynced."""
    dest = loc.join(name)

    def _write() -> None:
        if not loc.is_local:
            with loc.fs.open_output_stream(dest) as out:  # an object appears whole or not at all
                out.write(data)
            return
        # A file system shows partial writes: write aside, then rename into place.
        tmp = f"{dest}.tmp-{os.getpid()}-{threading.get_ident()}"

        def _aside() -> None:
            try:
                with loc.fs.open_output_stream(tmp) as out:
                    out.write(data)
                fsync_file(tmp)
                loc.fs.move(tmp, dest)
            finally:
                Path(tmp).unlink(missing_ok=True)  # a failed write or move leaves nothing aside

        _into_dir(loc, posixpath.dirname(dest), _aside)
        fsync_dir(posixpath.dirname(dest))

    policy.call(f"write of {loc.uri}/{name}", _write)


@contextmanager
def open_output(loc: StorageLocation, name: str) -> Iterator[Any]:
    """A stream to ``<loc>/<name>`` for a writer that makes the bytes as it goes (there is
    no local file to upload). On a file system it is written aside, fsynced and renamed into
    place; an object appears when the stream closes. A write that raises leaves nothing
    under ``name`` on a file system; on object storage pyarrow has no abort, so closing the
    stream publishes the partial object, which is then deleted, best effort (a reader may
    see it meanwhile; a failed delete leaves it: the manifest's sizes and checksums reject
    it). Not retried: the caller retries the whole write."""
    dest = loc.join(name)
    parent = posixpath.dirname(dest)
    target = f"{dest}.tmp-{os.getpid()}-{threading.get_ident()}" if loc.is_local else dest
    if loc.is_local:
        loc.fs.create_dir(parent, recursive=True)
    out = loc.fs.open_output_stream(target)
    try:
        yield out
        out.close()
        if loc.is_local:
            fsync_file(target)
            loc.fs.move(target, dest)
            fsync_dir(parent)
    except BaseException:
        with suppress(OSError):
            out.close()
        with suppress(OSError):  # not there (nothing was sent), or unreachable: nothing names it
            loc.fs.delete_file(target)
        raise


def touch(loc: StorageLocation, name: str, policy: RetryPolicy = DEFAULT_POLICY) -> None:
    """Create an empty file or object in one request; retried. Not fsynced: for files whose
    name is the message and whose loss after a crash costs nothing."""
    dest = loc.join(name)

    def _touch() -> None:
        loc.fs.open_output_stream(dest).close()

    if loc.is_local:
        policy.call(f"creation of {loc.uri}/{name}", lambda: _into_dir(loc, posixpath.dirname(dest), _touch))
    else:
        policy.call(f"creation of {loc.uri}/{name}", _touch)


def _into_dir(loc: StorageLocation, parent: str, write: Callable[[], T]) -> T:
    """``write`` into the local directory ``parent``, created first, and once more if it
    vanished meanwhile: retention removes a checkpoint directory once it is empty, which
    it may be between our creating it and our first file landing there."""
    for attempt in range(_DIR_ATTEMPTS):
        loc.fs.create_dir(parent, recursive=True)
        try:
            return write()
        except FileNotFoundError:
            if os.path.isdir(parent) or attempt == _DIR_ATTEMPTS - 1:
                raise  # not the directory (the source is missing), or it keeps vanishing
    raise AssertionError("unreachable")


def read_bytes(loc: StorageLocation, name: str, policy: RetryPolicy = DEFAULT_POLICY) -> bytes:
    """Read a whole (small) object; FileNotFoundError when it does not exist."""

    def _read() -> bytes:
        with loc.fs.open_input_file(loc.join(name)) as inp:
            return inp.read()

    try:
        return policy.call(f"read of {loc.uri}/{name}", _read)
    except StorageError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            raise exc.__cause__ from None
        raise


def list_dir(
    loc: StorageLocation, sub: str = "", *, recursive: bool = False, policy: RetryPolicy = DEFAULT_POLICY
) -> list[pafs.FileInfo]:
    """Entries under ``<loc>/<sub>``; empty when the directory does not exist."""
    selector = pafs.FileSelector(loc.join(sub) if sub else loc.root, allow_not_found=True, recursive=recursive)

    def _list() -> list[pafs.FileInfo]:
        # pyarrow's local listing looks for a directory only after listing it failed: one
        # created between the two (``checkpoints/`` by a background generation claim)
        # raises FileNotFoundError. Listing again sees it, or finds it gone (empty).
        for _ in range(_LIST_RACE_ATTEMPTS - 1):
            try:
                return loc.fs.get_file_info(selector)
            except FileNotFoundError:
                continue
        return loc.fs.get_file_info(selector)

    return policy.call(f"listing of {loc.uri}/{sub}", _list)


def file_sizes(loc: StorageLocation, policy: RetryPolicy = DEFAULT_POLICY) -> dict[str, int]:
    """Every file under ``loc`` (recursively): its name relative to ``loc`` -> bytes."""
    return {
        info.path[len(loc.root) + 1 :]: info.size or 0
        for info in list_dir(loc, recursive=True, policy=policy)
        if info.type == pafs.FileType.File
    }


def delete_file(loc: StorageLocation, name: str, policy: RetryPolicy = DEFAULT_POLICY) -> None:
    """Delete the file ``<loc>/<name>``; missing is fine; retried."""

    def _delete() -> None:
        try:
            loc.fs.delete_file(loc.join(name))
        except FileNotFoundError:
            pass

    policy.call(f"deletion of {loc.uri}/{name}", _delete)


def delete_dir(loc: StorageLocation, sub: str, policy: RetryPolicy = DEFAULT_POLICY) -> None:
    """Delete ``<loc>/<sub>`` and everything under it; missing is fine."""
    path = loc.join(sub)

    def _delete() -> None:
        try:
            loc.fs.delete_dir(path)
        except FileNotFoundError:
            pass

    policy.call(f"deletion of {loc.uri}/{sub}", _delete)
