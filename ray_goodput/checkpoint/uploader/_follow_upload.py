"""Uploading a shard's data file to object storage while DCP is still writing it.

The node uploader DCP-writes a shard into the staging dir (the node-local copy) and then
uploads it: time to durable was the write plus the upload. DCP writes a rank's data file
front to back, once (no seek back), so the upload can follow the file as it grows and end
right after the write does (:class:`FollowUpload`). The checksum and block checksums of
the manifest entry are computed on the bytes as they are sent, as in any upload.

When following fails (the write failed, or a request did), the job uploads the staged
file the usual way, with retries; a follower that failed after it began sending may
leave a partial object under the file's name, which it deletes (best effort) and which
no manifest names (its step is uncommitted until the normal upload replaces it).
Object storage only: local storage takes the staged files as hard links.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from ray_goodput.errors import CheckpointError, GoodputError
from ray_goodput.storage import CHUNK_BYTES, FileEntry, StorageLocation, copy_stream, upload_block_bytes

logger = logging.getLogger(__name__)

#: How often a follower looks for more bytes when it has caught up with the writer (it
#: shares the GIL with training when the uploader is a thread of the worker).
POLL_S = 0.01
#: A writer that adds nothing for this long, and has not said it is done, is given up on.
STALL_S = 600.0


class WriterFailed(GoodputError):
    """The file's writer failed: what was followed is not the file."""


class _Growing:
    """``read(n)`` over a file another thread appends to: waits for bytes until the
    writer says it is done (then returns what is left, then ``b""``). A write over before
    the file was first looked for is read under ``final``, the name it was renamed to."""

    def __init__(self, path: Path, final: Path, done: threading.Event, failed: threading.Event) -> None:
        self._path, self._final, self._done, self._failed = path, final, done, failed
        self._file = None
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file followed
        self._since = time.monotonic()

    def read(self, size: int) -> bytes:
        while True:
            if self._failed.is_set():
                raise WriterFailed(f"the write of {self._path} failed")
            finished = self._done.is_set()  # read after: bytes written before it are seen
            if self._file is None:
                try:
                    self._open(self._final if finished else self._path)
                except FileNotFoundError:
                    if finished:
                        raise WriterFailed(f"neither {self._path} nor {self._final} was written") from None
                    self._wait()
                    continue
            data = self._file.read(size)
            if data or finished:
                self._since = time.monotonic()
                return data
            self._wait()

    def _open(self, path: Path) -> None:
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - closed in close()
        except FileNotFoundError:
            if path == self._final:
                raise
            self._file = open(self._final, "rb")  # noqa: SIM115 - renamed since: done by now
        stat = os.fstat(self._file.fileno())
        self.identity = (stat.st_dev, stat.st_ino)

    def _wait(self) -> None:
        if time.monotonic() - self._since > STALL_S:
            raise WriterFailed(f"nothing was added to {self._path} for {STALL_S:.0f} s")
        self._done.wait(POLL_S)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class FollowUpload:
    """Upload ``path`` as ``<loc>/<name>`` while it is being written, in a thread;
    ``final``: the name the writer renames it to once written."""

    def __init__(
        self, path: Path, final: Path, loc: StorageLocation, name: str, algorithm: str, size_hint: int = 0
    ) -> None:
        self.name = name
        self._loc, self._algorithm = loc, algorithm
        # About the file's size (it is still being written), padded for DCP's records.
        self._block_bytes = upload_block_bytes(size_hint + (size_hint >> 6))
        self._done, self._failed = threading.Event(), threading.Event()
        self._source = _Growing(path, final, self._done, self._failed)
        self._entry: FileEntry | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rg-follow-upload", daemon=True)
        self._thread.start()

    def writer_done(self, ok: bool) -> None:
        """The writer finished (``ok``) or failed: a follower stops at the end, or at once."""
        (self._done if ok else self._failed).set()

    def abandon(self, timeout_s: float) -> bool:
        """The write failed: stop following, and wait (bounded) until the follower let go
        of the file (its disk space) and took back what it sent. False when it did not stop
        in ``timeout_s`` (it may still send or delete the object)."""
        self._failed.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the upload following %s did not stop in %.0f s", self.name, timeout_s)
            return False
        return True

    def result(self, written: Path, timeout_s: float, stop_s: float) -> FileEntry | None:
        """The uploaded file's entry once the follower ended; None when it failed, or sent
        another file or size than ``written`` (the staged file, renamed: the same inode),
        and the caller uploads the file itself. A follower that did not end in
        ``timeout_s``, nor ``stop_s`` after being told to stop, fails the save: uploading
        the file again would race it on the same object."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.abandon(stop_s)
            if self._thread.is_alive():
                raise CheckpointError(
                    f"the upload of {self.name} (following its write) neither ended in "
                    f"{timeout_s:.0f} s nor stopped in {stop_s:.0f} s; check the storage"
                )
            return None
        if self._error is not None:
            logger.info(
                "could not upload %s while it was written (%s: %s); uploading it now",
                self.name,
                type(self._error).__name__,
                self._error,
            )
            return None
        stat = written.stat()
        if (
            self._entry is None
            or self._entry.size != stat.st_size
            or self._source.identity != (stat.st_dev, stat.st_ino)
        ):
            logger.warning(
                "%s: the upload that followed its write saw another file (%s bytes, the file "
                "has %d); uploading it again",
                self.name,
                self._entry.size if self._entry else None,
                stat.st_size,
            )
            return None
        return self._entry

    def _run(self) -> None:
        dest = self._loc.join(self.name)
        blocks: list[int] = []
        block_bytes = self._block_bytes
        try:
            with self._loc.fs.open_output_stream(dest) as out:
                size, crc = copy_stream(
                    self._source,
                    out,
                    algorithm=self._algorithm,
                    chunk_bytes=CHUNK_BYTES,
                    blocks=blocks,
                    block_bytes=block_bytes,
                )
            self._entry = FileEntry(
                name=self.name,
                size=size,
                crc32=crc,
                algorithm=self._algorithm,
                block_bytes=block_bytes,
                blocks=tuple(blocks),
            )
        except Exception as exc:  # noqa: BLE001 - reported by result(); the caller falls back
            self._error = exc
            self._delete_partial(dest)
        finally:
            self._source.close()

    def _delete_partial(self, dest: str) -> None:
        try:
            self._loc.fs.delete_file(dest)
        except OSError:  # not there (nothing was sent), or unreachable: no manifest names it
            pass
