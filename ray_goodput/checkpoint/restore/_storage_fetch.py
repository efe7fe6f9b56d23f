"""Getting a checkpoint file from storage for a restore, checked: the half of
:class:`~ray_goodput.checkpoint.restore._tiered_fs.TieredFs` that reads storage.

A file of local storage is mapped and checked in the page cache (``_mmap``). From
object storage, a file of which the rank needs only some ranges (another rank's data
file) is read only in the blocks of its manifest entry that hold them, each checked
against its own checksum; a large one without block checksums is streamed past its
checksum keeping only the needed ranges (``_byte_ranges``); any other file is read whole in
one request and checked in memory (up to the hold budget), or downloaded to the staging
directory and checked on the way. The rank's own files can be fetched early, in the
background, while DCP plans (``_prefetch``).
"""

from __future__ import annotations

import pyarrow as pa

from ray_goodput.checkpoint.restore import _byte_ranges
from ray_goodput.checkpoint.restore._mmap import MappedFile
from ray_goodput.checkpoint.restore._prefetch import Early, Found
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import (
    CHUNK_BYTES,
    CRC32,
    REMOTE_READ_BYTES,
    FileEntry,
    checksum,
    copy_stream,
    download_file,
    read_bytes,
)

#: A file from storage of which the rank needs at most a quarter (and that is this large)
#: is streamed past its checksum keeping only the needed ranges (``_byte_ranges``): typically
#: another rank's data file, for the few replicated records its owner wrote.
SPARSE_MIN_BYTES = 64 << 20


class StorageFetch:
    """Mixin of :class:`~ray_goodput.checkpoint.restore._tiered_fs.TieredFs`: reads from
    ``self.remote`` into its ``held``/``mapped``/``sparse`` files and counters (the
    attributes that class sets up)."""

    def _mismatch(self, name: str, size: int, crc: int, want: FileEntry) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{self.remote.uri}/{name}: {size} bytes {want.algorithm}={crc:#x}, manifest "
            f"says {want.size} bytes {want.algorithm}={want.crc32:#x}"
        )

    def _fetch(self, name: str, ranges: list[tuple[int, int]] | None) -> None:
        want = self.entries.get(name)
        runs = _block_runs(want, ranges) if want is not None and ranges is not None else None
        if (
            want is not None
            and self.remote.is_local
            and self._map_stored(
                name, runs, want, keep=not (ranges is not None and 2 * sum(length for _, length in ranges) <= want.size)
            )
        ):
            return
        if runs is not None and _runs_bytes(want, runs) <= self.hold_left:
            self._fetch_blocks(name, runs, want)
            return
        if (
            want is not None
            and ranges is not None
            and want.size >= SPARSE_MIN_BYTES
            and 4 * sum(length for _, length in ranges) <= want.size
        ):
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

    def _map_stored(self, name: str, runs: list[tuple[int, int]] | None, want: FileEntry, *, keep: bool) -> bool:
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

    def _checked_stored_map(self, name: str, runs: list[tuple[int, int]] | None, want: FileEntry) -> MappedFile | None:
        """A file of local storage mapped and checked (``runs``: only those blocks); None
        when it cannot be mapped; CheckpointCorruptError when it is damaged."""
        mapped = self.guard.map(self.remote.join(name))
        if mapped is None:
            return None
        try:
            if mapped.size != want.size:
                raise CheckpointCorruptError(
                    f"{self.remote.uri}/{name}: {mapped.size} bytes, manifest says {want.size} bytes"
                )
            for first, last in runs or ():
                for block in range(first, last + 1):
                    crc = mapped.checksum(want.algorithm, block * want.block_bytes, want.block_bytes)
                    if crc != want.blocks[block]:
                        raise CheckpointCorruptError(
                            f"{self.remote.uri}/{name}: block {block} has {want.algorithm}={crc:#x}, "
                            f"manifest says {want.blocks[block]:#x}"
                        )
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
        background (``_prefetch``); :meth:`prepare` takes what was found when DCP asks."""
        for name in names:
            want = self.entries.get(name)
            if want is None or name in self.ready or name in self.early or name in self.local_names:
                continue
            hold = not self.remote.is_local and want.size <= self.hold_left
            self.hold_left -= want.size if hold else 0  # reserved until taken
            self.early.start(
                name,
                lambda n=name, w=want, u=name in self.unchecked, h=hold: self._fetch_whole(n, w, u, h),
                want.size if hold else 0,
            )

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

        def read() -> tuple[int, int, _byte_ranges.Capture]:
            sink = _byte_ranges.Capture(ranges)
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
                return actual, [
                    (first * size, inp.read_at(min(want.size, (last + 1) * size) - first * size, first * size))
                    for first, last in runs
                ]

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
                        f"{block * size}) has {want.algorithm}={crc:#x}, manifest says {want.blocks[block]:#x}"
                    )
        self.sparse[name] = _byte_ranges.Capture.of(got)
        self.hold_left -= sum(len(data) for _, data in got)
        self.block_bytes_held += sum(len(data) for _, data in got)


def _intact(mapped: MappedFile, want: FileEntry) -> bool:
    """Whether a mapped file matches its manifest entry; closes it when it does not."""
    if (mapped.size, mapped.checksum(want.algorithm)) == (want.size, want.crc32):
        return True
    mapped.close()
    return False


def _block_runs(want: FileEntry, ranges: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """Runs ``(first, last)`` of the blocks of ``want`` that hold ``ranges``; None when the
    entry has no block checksums or the blocks are over half the file (then one whole read
    is as good)."""
    if not want.blocks:
        return None
    size = want.block_bytes
    needed = sorted(
        {b for offset, length in ranges if length > 0 for b in range(offset // size, (offset + length - 1) // size + 1)}
    )
    runs: list[tuple[int, int]] = []
    for block in needed:
        if runs and runs[-1][1] == block - 1:
            runs[-1] = (runs[-1][0], block)
        else:
            runs.append((block, block))
    return runs if runs and 2 * _runs_bytes(want, runs) <= want.size else None


def _runs_bytes(want: FileEntry, runs: list[tuple[int, int]]) -> int:
    return sum(min(want.size, (last + 1) * want.block_bytes) - first * want.block_bytes for first, last in runs)
