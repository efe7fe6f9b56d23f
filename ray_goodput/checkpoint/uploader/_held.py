"""Jobs saved before their worker could send them to the node uploader, kept as files until taken.

A save made while a worker's first connection to its node's uploader is still being made
(the uploader still starting), or that cannot be sent at once (no room in the socket for
its frame, no live connection, or jobs going by actor calls), does not wait for it: the worker writes the job
here (one file per job, in a directory of its node) and a thread of the worker hands it
over once the uploader answers. Whoever takes a job first removes its file: the uploader when
the job reaches it, or the uploader's look for the jobs of workers that died before they
could hand theirs over (at its start, at each registration and once a second). So a save
that returned survives its worker either way, as a save handed over does.

The directory, ``$TMPDIR/ray_goodput-<uid>/held``, is this user's alone (mode 0700, and
nothing above it another user could swap: ``runtime._private_dirs``), as the uploader
unpickles what it finds there; held jobs under one that is not are never read.

Its snapshot arena carries a mark (``_arena_files.mark_held``) from before the file is written
until an uploader mapped it, so the sweep of dead workers' arenas that the run's next
worker makes keeps it.

A file is taken by renaming it to ``.<taker pid>.taken`` (one of several takers wins) and
removed when its job has ended. The name carries the worker's pid and the job's key; the
worker is dead when no process runs under that pid, or the one that does started well after
the file was written (the pid was reused: ``runtime.pid_alive``'s ``since``). A job whose
taker died is taken again by the next look, as a dead worker's is, and runs again from its
snapshot (``_settle_claim`` says why the claim the dead taker left is its own).

Held jobs of a node whose uploader never comes up again (the node's Ray instance is gone:
its id is not reused) would stay; each uploader, at its start, removes the files under other
nodes' directories that were last touched over ``OTHER_NODE_SWEEP_AGE_S`` ago by a process
now dead, each a save lost, with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ray_goodput import _env
from ray_goodput.checkpoint.save import _arena_files
from ray_goodput.runtime import pid_alive
from ray_goodput.runtime._private_dirs import is_private, make_private

if TYPE_CHECKING:
    from ray_goodput.checkpoint.uploader._shard_job import ShardJob

logger = logging.getLogger(__name__)

_JOB, _TAKEN = ".job", ".taken"

#: Held files under another node's directory older than this, whose writer or taker is
#: dead, are removed at an uploader's start (an hour: far past any uploader's start).
OTHER_NODE_SWEEP_AGE_S = 3600.0


def held_root() -> Path:
    """The held jobs' directory: this user's alone (the uploader unpickles what it finds)."""
    return _env.user_dir() / "held"


def held_dir(node_id: str) -> Path:
    """The directory of one node's held jobs (node-local, shared by its workers and uploader)."""
    return held_root() / node_id


def _ours() -> bool:
    """Whether the held jobs' directory is this user's alone: else nothing in it is read."""
    if is_private(held_root()):
        return True
    if held_root().exists():
        logger.warning("not reading held jobs under %s: it is not this user's alone (mode 0700)", held_root())
    return False


def _name(pid: int, key: str) -> str:
    return f"{pid}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def hold(node_id: str, job: ShardJob, root: bytes | None) -> Path:
    """Write ``job`` (its storage root pickled apart, as the uploader takes it) to the node's
    held jobs, whole or not at all; returns its file. When it cannot (a full disk), the
    error is raised and nothing is left: no partial file, no mark on the arena."""
    directory = held_dir(node_id)
    path = directory / (_name(job.owner_pid, job.key) + _JOB)
    if job.slots:  # before the file: a sweep of dead workers' arenas must keep its snapshot
        _arena_files.mark_held(job.arena_path, job.key)
    partial = path.with_suffix(".partial")
    try:
        for last in (False, True):
            make_private(held_root())
            directory.mkdir(mode=0o700, exist_ok=True)
            try:
                partial.write_bytes(pickle.dumps((job, root)))
                break
            except FileNotFoundError:  # the directory was swept as empty meanwhile
                if last:
                    raise
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        arena_mapped(job)  # no file will ask the sweep to keep it
        raise
    return path


def take(node_id: str, job: ShardJob) -> bool:
    """The uploader got ``job``: False when the look for dead workers' jobs took it already
    (this copy is its duplicate); True otherwise, its held file (if any) removed."""
    directory, name = held_dir(node_id), _name(job.owner_pid, job.key)
    if any(directory.glob(f"{name}.*{_TAKEN}")):
        return False
    (directory / (name + _JOB)).unlink(missing_ok=True)
    return True


def orphans(node_id: str) -> list[tuple[Path, ShardJob, bytes | None]]:
    """The held jobs of workers no longer alive that no live process has taken, each taken
    by this process (renamed ``.<pid>.taken``: no other taker gets it), oldest save first;
    the caller hands each on and calls :func:`remove`."""
    directory = held_dir(node_id)
    if not _ours():
        return []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = directory / name
        holder = _holder(name)
        if holder is None or _alive(path, holder):
            continue
        taken = directory / f"{name.split('.', 1)[0]}.{os.getpid()}{_TAKEN}"
        try:
            os.rename(path, taken)
            os.utime(taken)  # when it was taken: what tells this taker from a later one with its pid
        except FileNotFoundError:  # handed over meanwhile, or another look took it
            continue
        try:
            job, root = pickle.loads(taken.read_bytes())  # noqa: S301 - written by our own workers, in a directory only we can write
        except Exception as exc:  # noqa: BLE001 - an unreadable file is one lost save, not an uploader down
            logger.warning("cannot read the held job %s of a dead worker: %s; dropping it", taken, exc)
            taken.unlink(missing_ok=True)
            continue
        if job.slots and not _settle_claim(job, retaken=name.endswith(_TAKEN)):
            logger.info("held job %s was superseded by its worker before it died; dropping it", job.key)
            remove(taken, job)
            continue
        out.append((taken, job, root))
    return sorted(out, key=lambda t: t[1].step)


def pending(node_id: str) -> list[tuple[ShardJob, bytes | None]]:
    """The held jobs of workers still alive that nobody has taken yet: saves that returned
    and will reach the uploader (their worker hands them over, or the look for dead
    workers' jobs takes them once it dies), each with its storage root, pickled."""
    if not _ours():
        return []
    out = []
    for path in held_dir(node_id).glob(f"*{_JOB}"):
        holder = _holder(path.name)
        if holder is None or not _alive(path, holder):
            continue  # a dead worker's: the look for orphans takes it
        try:
            job, root = pickle.loads(path.read_bytes())  # noqa: S301 - written by our own workers, in a directory only we can write
        except FileNotFoundError:  # handed over or taken meanwhile
            continue
        except Exception as exc:  # noqa: BLE001 - an unreadable file is the look's to report
            logger.debug("cannot read the held job %s: %s", path, exc)
            continue
        out.append((job, root))
    return out


def _settle_claim(job: ShardJob, *, retaken: bool) -> bool:
    """Whether ``job``'s snapshot is still its own, for the uploader's claim before reading.

    Only the worker writes its arenas, after claiming the waiting job's snapshot (to
    supersede it), and only while alive: so a claim found when a dead worker's job is first
    taken is the worker's (superseded: False), and a claim found when a dead taker's job is
    taken again is that taker's, made as it began the job: it is removed, and the job runs
    again from the same snapshot."""
    if retaken:
        _arena_files.drop_claim(job.arena_path, job.key)
        return True
    return not _arena_files.claim_path(job.arena_path, job.key).exists()


def _holder(name: str) -> int | None:
    """The process a held file waits on: its worker (``<pid>-<key>.job``) or its taker
    (``<pid>-<key>.<taker>.taken``); None for any other file (a partial write)."""
    if name.endswith(_JOB):
        pid = name.split("-", 1)[0]
    elif name.endswith(_TAKEN):
        pid = name[: -len(_TAKEN)].partition(".")[2]
    else:
        return None
    return int(pid) if pid.isdigit() else None


def _alive(path: Path, pid: int) -> bool:
    """Whether the process that wrote or took ``path`` still runs: a process under its pid
    that started well after the file was last touched is a later one that reuses the pid."""
    try:
        touched = path.stat().st_mtime
    except FileNotFoundError:  # handed over or taken meanwhile: not an orphan
        return True
    return pid_alive(pid, since=touched)


def sweep_other_nodes(node_id: str) -> int:
    """Remove the held files of other nodes last touched over ``OTHER_NODE_SWEEP_AGE_S`` ago
    whose writer or taker is dead, and their directories once empty; returns how many."""
    removed = 0
    now = time.time()
    if not _ours():
        return 0
    for directory in held_dir(node_id).parent.glob("*"):
        if directory.name == node_id or not directory.is_dir():
            continue
        try:
            for path in directory.iterdir():
                holder = _holder(path.name)
                try:
                    old = now - path.stat().st_mtime > OTHER_NODE_SWEEP_AGE_S
                except FileNotFoundError:
                    continue
                if old and (holder is None or not _alive(path, holder)):
                    logger.warning("removing %s: a save held on node %s that no uploader took", path, directory.name)
                    path.unlink(missing_ok=True)
                    removed += 1
        except OSError as exc:  # removed meanwhile, or not ours to read: left as it is
            logger.info("could not sweep the held jobs under %s: %s", directory, exc)
            continue
        with contextlib.suppress(OSError):  # not empty, or removed meanwhile
            directory.rmdir()
    return removed


def remove(path: Path, job: ShardJob) -> None:
    """A taken job's file goes, and its arena's mark: the job ended or could not run."""
    path.unlink(missing_ok=True)
    arena_mapped(job)


def arena_mapped(job: ShardJob) -> None:
    """An uploader mapped ``job``'s arena (or nobody will): the sweep of dead workers'
    arenas may take it once its worker is gone (a mark of a job held here, if any, goes)."""
    if job.slots:
        _arena_files.unmark_held(job.arena_path, job.key)
