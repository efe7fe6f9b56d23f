"""Node-local directories that only this user can write, and nobody can swap for another.

Some node-local files are unpickled when read back (a goodput event spool's storage
location, a held checkpoint job): another local user who could put a file there, or put
another directory in place of ours, would run code in our processes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def is_private(directory: Path) -> bool:
    """Whether ``directory`` is this user's alone and nobody else can put another in its
    place: it is this user's, mode 0700; every directory above it is this user's or root's,
    and one that others may write has the sticky bit (as ``/tmp``); and every symbolic link
    on the way is this user's or root's. Else its owner, or anyone who may write it, could
    rename ours away, or point the link elsewhere, and put theirs there."""
    try:
        info = directory.lstat()
    except OSError:
        return False
    if not (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077):
        return False
    for link in Path(os.path.abspath(directory)).parents:  # a link its owner could point elsewhere
        try:
            link_info = link.lstat()
        except OSError:
            return False
        if stat.S_ISLNK(link_info.st_mode) and link_info.st_uid not in (0, os.getuid()):
            return False
    above = Path(os.path.realpath(directory.parent))
    return all(_cannot_be_swapped_in(d) for d in (above, *above.parents))


def _cannot_be_swapped_in(directory: Path) -> bool:
    try:
        info = directory.stat()
    except OSError:
        return False
    if info.st_uid not in (0, os.getuid()):
        return False
    return not info.st_mode & 0o022 or bool(info.st_mode & stat.S_ISVTX)


def make_private(directory: Path, *, setting: str | None = None) -> Path:
    """``directory``, made (with its parents) this user's alone; PermissionError when it, or
    a directory above it, is not safe (see :func:`is_private`), naming ``setting`` (the
    environment variable that moves it) as the fix."""
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    if not is_private(directory):
        fix = f"set {setting} to such a directory" if setting else "set TMPDIR to such a directory"
        raise PermissionError(
            f"{directory} is not this user's alone (mode 0700, owner uid {os.getuid()}, under directories "
            f"only this user or root can write, or sticky): {fix}"
        )
    return directory
