"""Checksummed copies: the one loop that moves bytes and checksums them on the way.

Every transfer (upload, download, cache fetch, verification) goes through
:func:`copy_stream`, so all of them use the same chunk size and the same checksum.

Checkpoint files get CRC32C (``google-crc32c``, hardware-accelerated: ~4x zlib's CRC32
here, so the background upload costs training less CPU). Files recorded before carry
CRC32 (manifests without a ``checksum`` field) and still verify: a checksum is always
computed with the algorithm its record names. The public transfer functions keep CRC32
(``FileEntry.crc32``) unless told otherwise.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

import google_crc32c

#: Bytes per read: large enough for object stores, small enough to bound memory per stream.
CHUNK_BYTES = 8 << 20
#: Bytes per read from an object store when downloading: each read is one ranged GET, and
#: per-request latency (and, on some S3 servers, a cost per request in the object's size)
#: makes 8 MiB requests several times slower than a few large ones.
REMOTE_READ_BYTES = 128 << 20

CRC32 = "crc32"
CRC32C = "crc32c"
#: The algorithm of every checkpoint file's checksum recorded from now on.
DEFAULT_ALGORITHM = CRC32C

_EXTEND: dict[str, Callable[[int, bytes], int]] = {
    CRC32: lambda crc, data: zlib.crc32(data, crc),
    CRC32C: lambda crc, data: google_crc32c.extend(crc, data),
}


class _Writable(Protocol):
    def write(self, data: bytes) -> object: ...


def _extender(algorithm: str) -> Callable[[int, bytes], int]:
    try:
        return _EXTEND[algorithm]
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(_EXTEND)}") from None


def checksum(data: bytes, algorithm: str = DEFAULT_ALGORITHM) -> int:
    """The ``algorithm`` checksum of ``data``."""
    return _extender(algorithm)(0, data)


def copy_stream(src: BinaryIO, dst: _Writable | None = None, *,
                check: Callable[[int], None] | None = None,
                algorithm: str = DEFAULT_ALGORITHM, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, int]:
    """Copy ``src`` to ``dst`` (or only read it, when ``dst`` is None) in ``chunk_bytes`` reads.

    Returns ``(bytes, checksum)``. ``check(bytes_so_far)`` runs after each chunk is read
    and before it is written; it raises to stop the copy (e.g. a size limit).
    """
    extend = _extender(algorithm)
    crc, size = 0, 0
    while chunk := src.read(chunk_bytes):
        size += len(chunk)
        if check is not None:
            check(size)
        crc = extend(crc, chunk)
        if dst is not None:
            dst.write(chunk)
    return size, crc


def file_crc32(path: str | Path, algorithm: str = CRC32) -> tuple[int, int]:
    """``(size, checksum)`` of a local file (the name predates CRC32C)."""
    with open(path, "rb") as f:
        return copy_stream(f, algorithm=algorithm)
