"""Checksummed copies: the one loop that moves bytes and checksums them on the way.

Every transfer (upload, download, cache fetch, verification) goes through
:func:`copy_stream`, so all of them use the same chunk size and the same checksum.

Checkpoint files get CRC32C (``google-crc32c``, hardware-accelerated: ~4x zlib's CRC32
here, so the background upload costs training less CPU). Files recorded before carry
CRC32 (manifests without a ``checksum`` field) and still verify: a checksum is always
computed with the algorithm its record names. The public transfer functions keep CRC32
(``FileEntry.crc32``) unless told otherwise.

An upload also records one checksum per ``BLOCK_BYTES`` block, in the same pass (the
whole file's checksum is combined from the blocks' ones, not computed a second time): a
reader that needs a few ranges of a large file reads and checks only the blocks that hold
them, not the whole file.
"""

from __future__ import annotations

import functools
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

import google_crc32c
import pyarrow as pa

#: Bytes per read: large enough for object stores, small enough to bound memory per stream.
CHUNK_BYTES = 8 << 20
#: Bytes per read from an object store when downloading: each read is one ranged GET, and
#: per-request latency (and, on some S3 servers, a cost per request in the object's size)
#: makes 8 MiB requests several times slower than a few large ones.
REMOTE_READ_BYTES = 128 << 20

#: Bytes per block of a file's block checksums (recorded with each entry: a reader uses
#: the size its manifest names). A reader that needs a few small records of a file (a
#: peer's optimizer step counters) reads and checks one block for them; computing 72
#: checksums per 72 MiB costs about what 9 do (docs/design/save-path.md).
BLOCK_BYTES = 1 << 20
#: At most this many blocks per file: a larger file gets larger blocks (doubling), so a
#: manifest lists at most ~12 KB of block checksums per file at any shard size.
MAX_BLOCKS = 1024


def upload_block_bytes(size: int = 0) -> int:
    """The block size of the block checksums an upload of ``size`` bytes (or about that:
    a file still being written) records now: :data:`BLOCK_BYTES`, doubled until the file
    has at most :data:`MAX_BLOCKS` blocks (both read at each call, so that a benchmark or
    test can set them)."""
    block = BLOCK_BYTES
    while size > block * MAX_BLOCKS:
        block *= 2
    return block


CRC32 = "crc32"
CRC32C = "crc32c"
#: The algorithm of every checkpoint file's checksum recorded from now on.
DEFAULT_ALGORITHM = CRC32C

_EXTEND: dict[str, Callable[[int, bytes], int]] = {
    CRC32: lambda crc, data: zlib.crc32(data, crc),
    CRC32C: lambda crc, data: google_crc32c.extend(crc, data),
}
#: The reflected generator polynomial of each algorithm (for :func:`combine_checksums`).
_POLYNOMIAL = {CRC32: 0xEDB88320, CRC32C: 0x82F63B78}


class _Writable(Protocol):
    def write(self, data: bytes) -> object: ...


def _extender(algorithm: str) -> Callable[[int, bytes], int]:
    try:
        return _EXTEND[algorithm]
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(_EXTEND)}") from None


#: A checksum of a larger buffer is computed in slices of this size, with the GIL let go
#: between them: google-crc32c holds it through a whole call (milliseconds per
#: 72 MiB during which a restore's main thread, planning while its own file is checked in
#: the background, could not run).
GIL_SLICE_BYTES = 4 << 20


def checksum(data: bytes | bytearray | memoryview | pa.Buffer, algorithm: str = DEFAULT_ALGORITHM) -> int:
    """The ``algorithm`` checksum of ``data`` (a large buffer in slices, see
    ``GIL_SLICE_BYTES``)."""
    extend = _extender(algorithm)
    if isinstance(data, bytes) and len(data) <= GIL_SLICE_BYTES:
        return extend(0, data)
    view = memoryview(data).cast("B")
    crc = extend(0, b"")
    for offset in range(0, len(view), GIL_SLICE_BYTES):
        if offset:
            time.sleep(0)  # lets a waiting thread take the GIL now, not at the next 5 ms switch
        crc = extend(crc, pa.py_buffer(view[offset : offset + GIL_SLICE_BYTES]))  # google-crc32c: no memoryview
    return crc


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    """``matrix`` (32 columns over GF(2)) times ``vector``."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_times(matrix, column) for column in matrix)


@functools.lru_cache(maxsize=64)
def _append_zeros(polynomial: int, nbytes: int) -> tuple[int, ...]:
    """The linear map that a CRC register undergoes when ``nbytes`` zero bytes are fed."""
    power = (polynomial,) + tuple(1 << n for n in range(31))  # one zero bit
    for _ in range(3):
        power = _gf2_square(power)  # 2, 4, 8 bits: one byte
    result: tuple[int, ...] | None = None
    while nbytes:
        if nbytes & 1:
            result = power if result is None else tuple(_gf2_times(power, c) for c in result)
        nbytes >>= 1
        if nbytes:
            power = _gf2_square(power)
    assert result is not None
    return result


def combine_checksums(first: int, second: int, second_bytes: int, algorithm: str = DEFAULT_ALGORITHM) -> int:
    """The checksum of ``A + B`` from the checksums of ``A`` and ``B`` (``B`` being
    ``second_bytes`` long), without the bytes (as zlib's ``crc32_combine``)."""
    if algorithm not in _POLYNOMIAL:
        _extender(algorithm)  # the error that names the known ones
    if second_bytes < 0:
        raise ValueError(f"second_bytes must be >= 0, got {second_bytes}")
    if second_bytes == 0:
        return first
    return _gf2_times(_append_zeros(_POLYNOMIAL[algorithm], second_bytes), first) ^ second


class _Blocks:
    """Per-block checksums of a stream fed in chunks of any size; the whole stream's
    checksum is combined from them."""

    def __init__(self, algorithm: str, block_bytes: int, out: list[int]) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.extend, self.algorithm, self.block_bytes, self.out = _extender(algorithm), algorithm, block_bytes, out
        self.whole, self.crc, self.fill = 0, 0, 0

    def update(self, chunk: bytes) -> None:
        start = 0
        while start < len(chunk):
            take = min(len(chunk) - start, self.block_bytes - self.fill)
            # google-crc32c refuses memoryviews; a pyarrow buffer slice is a view it takes.
            piece = chunk if take == len(chunk) else pa.py_buffer(chunk).slice(start, take)
            self.crc = self.extend(self.crc, piece)
            self.fill += take
            start += take
            if self.fill == self.block_bytes:
                self._close_block()

    def _close_block(self) -> None:
        self.out.append(self.crc)
        self.whole = combine_checksums(self.whole, self.crc, self.fill, self.algorithm)
        self.crc, self.fill = 0, 0

    def finish(self) -> int:
        if self.fill:
            self._close_block()
        return self.whole


def copy_stream(
    src: BinaryIO,
    dst: _Writable | None = None,
    *,
    check: Callable[[int], None] | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    chunk_bytes: int = CHUNK_BYTES,
    blocks: list[int] | None = None,
    block_bytes: int | None = None,
) -> tuple[int, int]:
    """Copy ``src`` to ``dst`` (or only read it, when ``dst`` is None) in ``chunk_bytes`` reads.

    Returns ``(bytes, checksum)``. ``check(bytes_so_far)`` runs after each chunk is read
    and before it is written; it raises to stop the copy (e.g. a size limit). ``blocks``:
    a list that receives the checksum of each ``block_bytes`` block (default
    :data:`BLOCK_BYTES`), computed in the same pass.
    """
    extend = _extender(algorithm)
    per_block = None if blocks is None else _Blocks(algorithm, block_bytes or BLOCK_BYTES, blocks)
    crc, size = 0, 0
    while chunk := src.read(chunk_bytes):
        size += len(chunk)
        if check is not None:
            check(size)
        if per_block is None:
            crc = extend(crc, chunk)
        else:
            per_block.update(chunk)
        if dst is not None:
            dst.write(chunk)
    return size, (crc if per_block is None else per_block.finish())


def file_crc32(
    path: str | Path, algorithm: str = CRC32, *, blocks: list[int] | None = None, block_bytes: int | None = None
) -> tuple[int, int]:
    """``(size, checksum)`` of a local file (the name predates CRC32C); ``blocks``: see
    :func:`copy_stream`."""
    with open(path, "rb") as f:
        return copy_stream(f, algorithm=algorithm, blocks=blocks, block_bytes=block_bytes)
