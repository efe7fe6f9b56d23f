"""Jobs saved before their worker reached the node uploader, kept as files until taken.

A save made while a worker's first connection to its node's uploader is still being made
(the uploader still starting) does not wait for it: the worker writes the job here (one
small file per job, in a directory of its node) and a thread of the worker hands it over
once the uploader answers. Whoever takes a job first removes its file: the uploader when
the job reaches it, or the uploader's look for the jobs of workers that died before they
could hand theirs over (at its start, at each registration and once a second). So a save
that returned survives its worker either way, as a save handed over does.

A file is taken by renaming it to ``.taken`` (one of several takers wins) and removed when
its job has ended. The name carries the worker's pid and the job's key; the worker is dead
when no process runs under that pid, or the one that does started well after the file was
written (the pid was reused: ``runtime.pid_alive``'s ``since``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ray_goodput.runtime import pid_alive

if TYPE_CHECKING:
    from ray_goodput.checkpoint.uploader._shard_job import ShardJob

logger = logging.getLogger(__name__)

_JOB, _TAKEN = ".job", ".taken"


def held_dir(node_id: str) -> Path:
    """The directory of one node's held jobs (node-local, shared by its workers and uploader)."""
    return Path(tempfile.gettempdir()) / "ray_goodput" / "held" / node_id


def _name(pid: int, key: str) -> str:
    return f"{pid}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def hold(node_id: str, job: ShardJob, root: bytes | None) -> Path:
    """Write ``job`` (its storage root pickled apart, as the uploader takes it) to the node's
    held jobs, whole or not at all; returns its file."""
    directory = held_dir(node_id)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (_name(job.owner_pid, job.key) + _JOB)
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps((job, root)))
    os.replace(partial, path)
    return path


def take(node_id: str, job: ShardJob) -> bool:
    """The uploader got ``job``: False when the look for dead workers' jobs took it already
    (this copy is its duplicate); True otherwise, its held file (if any) removed."""
    path = held_dir(node_id) / _name(job.owner_pid, job.key)
    if path.with_suffix(_TAKEN).exists():
        return False
    path.with_suffix(_JOB).unlink(missing_ok=True)
    return True


def orphans(node_id: str) -> list[tuple[Path, ShardJob, bytes | None]]:
    """The held jobs of workers no longer alive, each taken (renamed ``.taken``: no other
    taker gets it), oldest save first; the caller hands each on and calls :func:`remove`."""
    directory = held_dir(node_id)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = directory / name
        if not name.endswith(_JOB) or _writer_alive(path, int(name.split("-", 1)[0])):
            continue
        taken = path.with_suffix(_TAKEN)
        try:
            os.rename(path, taken)
        except FileNotFoundError:  # handed over meanwhile, or another look took it
            continue
        try:
            job, root = pickle.loads(taken.read_bytes())  # noqa: S301 - written by our own workers
        except Exception as exc:  # noqa: BLE001 - an unreadable file is one lost save, not an uploader down
            logger.warning("cannot read the held job %s of a dead worker: %s; dropping it", taken, exc)
            taken.unlink(missing_ok=True)
            continue
        out.append((taken, job, root))
    return sorted(out, key=lambda t: t[1].step)


def _writer_alive(path: Path, pid: int) -> bool:
    """Whether the worker that wrote ``path`` still runs: a process under its pid that
    started well after the file was written is a later one that reuses the pid."""
    try:
        written = path.stat().st_mtime
    except FileNotFoundError:  # handed over meanwhile: not an orphan
        return True
    return pid_alive(pid, since=written)


def remove(path: Path) -> None:
    """A held job's file goes: its job was handed over (by the worker), or a taken job ended."""
    path.unlink(missing_ok=True)
