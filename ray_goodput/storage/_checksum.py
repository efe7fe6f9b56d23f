"""Checksummed copies: the one loop that moves bytes and computes their CRC32 on the way.

Every transfer (upload, download, cache fetch, verification) goes through
:func:`copy_stream`, so all of them use the same chunk size and the same checksum.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

#: Bytes per read: large enough for object stores, small enough to bound memory per stream.
CHUNK_BYTES = 8 << 20


class _Writable(Protocol):
    def write(self, data: bytes) -> object: ...


def copy_stream(src: BinaryIO, dst: _Writable | None = None, *,
                check: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Copy ``src`` to ``dst`` (or only read it, when ``dst`` is None) in chunks.

    Returns ``(bytes, crc32)``. ``check(bytes_so_far)`` runs after each chunk is read and
    before it is written; it raises to stop the copy (e.g. a size limit).
    """
    crc, size = 0, 0
    while chunk := src.read(CHUNK_BYTES):
        size += len(chunk)
        if check is not None:
            check(size)
        crc = zlib.crc32(chunk, crc)
        if dst is not None:
            dst.write(chunk)
    return size, crc


def file_crc32(path: str | Path) -> tuple[int, int]:
    """``(size, crc32)`` of a local file."""
    with open(path, "rb") as f:
        return copy_stream(f)
