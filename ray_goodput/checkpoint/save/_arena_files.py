"""Snapshot arena files across processes: their names, where they live, and when they go.

An arena file outlives the worker that wrote it (``_arena``), so the processes of a node
agree through files beside it, with no message and no wait between them:

- a *claim* (:func:`claim`) settles whether a waiting job's snapshot is still wanted: the
  first of the worker (superseding the job, to reuse the arena) and the uploader
  (starting to read it) to create the job's claim file wins;
- a *held mark* (:func:`mark_held`) says that a job no uploader has mapped yet still
  needs the arena, so that the sweeps keep it;
- the *sweep* (:func:`sweep_dead`) removes the arenas of dead workers that no job needs,
  and other runs' leftovers once old.

No torch here: the node uploader's module imports this without it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import shutil
import time
from pathlib import Path

from ray_goodput.runtime import pid_alive

logger = logging.getLogger(__name__)
SHM = Path("/dev/shm")
_ARENA_NAME = r"^rank-\d+-(\d+)(?:-\d+)?(?:-[0-9a-f]+)?\.arena"  # group 1: the worker's pid
_NAME_RE = re.compile(_ARENA_NAME + "$")
_CLAIM_RE = re.compile(_ARENA_NAME + r"\.[0-9a-f]+\.claim$")
_HELD_RE = re.compile(_ARENA_NAME + r"\.[0-9a-f]+\.held$")
#: A dead worker's claim files older than this are swept: an uploader has looked at its
#: claim long before (a job waits at most for the running one's deadline).
_CLAIM_SWEEP_AGE_S = 24 * 3600.0
#: Another run's arenas and claims of dead workers are swept once untouched this long: by
#: then its node's uploader has run or given up every job that could still read them.
OTHER_RUN_SWEEP_AGE_S = 3600.0
_SHM_ROOT = SHM / "ray_goodput"

_instances = itertools.count()


def arena_names(rank: int) -> tuple[str, str]:
    """The file names of a new Checkpointer's two arenas: its process and its own number
    in it (two Checkpointers of one process on one run, a trainer's and one that only
    restores, say, must not share files)."""
    pid, instance = os.getpid(), next(_instances)
    return tuple(f"rank-{rank:05d}-{pid}-{index}-{instance:x}.arena" for index in (0, 1))


def pick_dir(staging: Path, need_bytes: int) -> Path:
    """/dev/shm when it has twice ``need_bytes`` free, else ``staging``."""
    if SHM.is_dir() and shutil.disk_usage(SHM).free > 2 * need_bytes:
        return _SHM_ROOT
    return staging


def sweep_dead(directory: Path, *, other_runs: bool | None = None) -> None:
    """Remove arenas of processes that died (a killed worker cannot remove its own), and
    their claim files once old (an uploader may still look at a young one).

    ``directory`` is one run's. With ``other_runs`` (by default: when it is in /dev/shm,
    where a left arena holds memory until the node reboots) the other runs' directories
    beside it are swept too, of dead workers' arenas and claims untouched for
    ``OTHER_RUN_SWEEP_AGE_S``, and removed once empty: a run whose workers were all killed
    leaves them, and no later worker of that run may come to sweep them."""
    now = time.time()
    for path in directory.glob("rank-*.arena") if directory.is_dir() else []:
        match = _NAME_RE.match(path.name)
        written = _mtime(path)
        if match is None or written is None:
            continue
        pid = int(match.group(1))
        if pid_alive(pid, since=written):  # a later process given its pid is not its worker
            continue
        if _held_for_a_job(path, now):
            logger.info("kept the snapshot arena of dead process %d: a job of it waits for an uploader", pid)
            continue
        path.unlink(missing_ok=True)
        logger.info("removed the snapshot arena of dead process %d", pid)
    for path in directory.glob("rank-*.claim") if directory.is_dir() else []:
        match = _CLAIM_RE.match(path.name)
        written = _mtime(path)
        if match is None or written is None or pid_alive(int(match.group(1)), since=written):
            continue
        if now - written > _CLAIM_SWEEP_AGE_S:
            path.unlink(missing_ok=True)
    for path in directory.glob("rank-*.held") if directory.is_dir() else []:
        if not path.with_name(path.name.split(".arena.", 1)[0] + ".arena").exists():  # nothing to keep
            path.unlink(missing_ok=True)
    if other_runs if other_runs is not None else directory.parent == _SHM_ROOT:
        for run in _dirs(directory.parent):
            if run != directory:
                _sweep_other_run(run, now)


def held_for_a_job(arena: Path) -> bool:
    """Whether a job no uploader has mapped yet still needs ``arena`` (see ``mark_held``)."""
    return _held_for_a_job(arena, time.time())


def _held_for_a_job(arena: Path, now: float) -> bool:
    """Whether a job no uploader has mapped yet still needs ``arena`` (``mark_held``): a
    mark younger than ``OTHER_RUN_SWEEP_AGE_S`` whose uploader, if it names one, lives (a
    mark that does not is removed)."""
    keep = False
    for mark in arena.parent.glob(arena.name + ".*.held"):
        written = _mtime(mark)
        if written is not None and now - written <= OTHER_RUN_SWEEP_AGE_S and _reader_alive(mark, written):
            keep = True
        else:
            mark.unlink(missing_ok=True)
    return keep


def _reader_alive(mark: Path, written: float) -> bool:
    """Whether the uploader a mark names (none: a job in a file, which any uploader takes)
    still runs."""
    try:
        text = mark.read_text().strip()
    except OSError:  # removed meanwhile, or unreadable: keep the arena
        return True
    return not text.isdigit() or pid_alive(int(text), since=written)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile
        return None


def _dirs(root: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _sweep_other_run(run: Path, now: float) -> None:
    """Another run's directory: its dead workers' old arenas and claims, then the directory
    itself when that left it empty or it was empty and old (``Arena._ensure`` makes it
    again if one of its workers is about to write there)."""
    removed = 0
    try:
        old_dir = now - run.stat().st_mtime > OTHER_RUN_SWEEP_AGE_S
        entries = list(os.scandir(run))
    except FileNotFoundError:
        return
    for entry in entries:
        match = _NAME_RE.match(entry.name) or _CLAIM_RE.match(entry.name) or _HELD_RE.match(entry.name)
        if match is None:
            continue
        try:
            written = entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if now - written > OTHER_RUN_SWEEP_AGE_S and not pid_alive(int(match.group(1)), since=written):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    if removed:
        logger.info("removed %d snapshot files of dead processes left by another run in %s", removed, run)
    if removed == len(entries) and (removed or old_dir):
        try:
            run.rmdir()
        except OSError:  # not empty (written meanwhile) or gone: left as it is
            pass


def claim_path(arena_path: str | os.PathLike, key: str) -> Path:
    """The claim file of job ``key`` on the arena at ``arena_path``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return Path(f"{os.fspath(arena_path)}.{digest}.claim")


def claim(arena_path: str | os.PathLike, key: str) -> bool:
    """Claim job ``key``'s snapshot: True for the first caller only, of the worker (to
    supersede the job and reuse its arena) and the uploader (to start reading it). One
    atomic creation of an empty file (``O_EXCL``; microseconds on tmpfs, no data block
    even on a full disk): neither side waits for the other, however busy, niced or
    starved it is."""
    try:
        os.close(os.open(claim_path(arena_path, key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def drop_claim(arena_path: str | os.PathLike, key: str) -> None:
    """Remove job ``key``'s claim file (the uploader, once the job ended: nobody looks at
    it again; a worker claiming an ended job afterwards only reuses a free arena)."""
    claim_path(arena_path, key).unlink(missing_ok=True)


def held_path(arena_path: str | os.PathLike, key: str) -> Path:
    """The mark that job ``key``, not yet mapped by an uploader, needs the arena at ``arena_path``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return Path(f"{os.fspath(arena_path)}.{digest}.held")


def mark_held(arena_path: str | os.PathLike, key: str, reader: int | None = None) -> None:
    """Keep the arena of job ``key`` from the sweep of dead workers' arenas (``sweep_dead``)
    until an uploader mapped it: the worker may die before that. Made before the job is
    written to a file of the node or to an uploader's socket; removed by
    :func:`unmark_held` once an uploader mapped the arena, or the job ended without one.
    ``reader``: the pid of the uploader whose socket holds the job; the mark protects the
    arena only while that process lives (its unread frames die with it)."""
    held_path(arena_path, key).write_text("" if reader is None else str(reader))


def forget_reader(directory: Path, reader: int) -> None:
    """Remove the marks in ``directory`` that name uploader ``reader`` (it exits with no
    frame left to read)."""
    for mark in directory.glob("rank-*.held") if directory.is_dir() else []:
        try:
            if mark.read_text().strip() == str(reader):
                mark.unlink(missing_ok=True)
        except OSError:  # removed meanwhile
            continue


def unmark_held(arena_path: str | os.PathLike, key: str) -> None:
    held_path(arena_path, key).unlink(missing_ok=True)
