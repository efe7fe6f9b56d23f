"""fsync for file-system storage (local disk, NFS): "uploaded" must mean "on disk".

A file system may keep written data and new directory entries in memory; a crash then
loses a file that a later marker declares durable. Object stores need none of this: a
PUT that completed is durable.
"""

from __future__ import annotations

import os


def fsync_file(path: str) -> None:
    """Flush ``path``'s data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush ``path``'s entries (files created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
