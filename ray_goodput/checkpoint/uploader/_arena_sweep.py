"""The node uploader's removal of dead workers' snapshot arenas.

A killed worker cannot remove its two arenas (twice its shard, in ``/dev/shm``), and when
it ran its job's last attempt no later worker of the run sweeps them either. The uploader
remembers the arena directories of every worker whose jobs it ran, however the jobs came
(a connection, actor calls, a held file), and sweeps them once that worker's process is
gone, and all of them when it exits; a dead worker's arena goes as soon as its job
lets go of it. Arenas its jobs still use stay mapped in the uploader, and the arena of a
job not mapped yet (held in a file, or unread in a socket), or of a dead worker's held
job until that job ends, is marked and kept (``_arena_files.sweep_dead``)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ray_goodput.checkpoint.save import _arena_files
from ray_goodput.runtime import pid_alive

if TYPE_CHECKING:
    from ray_goodput.checkpoint.uploader._shard_job import ShardJob

logger = logging.getLogger(__name__)


class WorkersArenas:
    """The arena directories of the workers whose jobs an uploader ran. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # worker pid -> (its jobs' arena directories, when it last handed a job over: time.time())
        self._workers: dict[int, tuple[set[str], float]] = {}

    def ran(self, job: ShardJob) -> None:
        """The uploader accepted ``job``, whose snapshot is in an arena."""
        with self._lock:
            directories, _ = self._workers.get(job.owner_pid, (set(), 0.0))
            directories.add(str(Path(job.arena_path).parent))
            self._workers[job.owner_pid] = (directories, time.time())

    def released(self, job: ShardJob) -> None:
        """``job`` let go of its arena. When its worker is gone nobody else frees it, unless
        a job not mapped yet still needs it: a newer save of that worker copied into it
        (held in a file, or unread in a socket), or this job itself, taken from a dead
        worker's held file, which the next uploader takes again if this one dies."""
        if not job.slots:  # its snapshot had no tensors: no arena
            return
        arena = Path(job.arena_path)
        if not pid_alive(job.owner_pid) and not _arena_files.held_for_a_job(arena):
            arena.unlink(missing_ok=True)

    def sweep_gone(self, connected: set[int | None]) -> None:
        """Sweep the directories of the workers whose process is gone. A ``connected``
        worker is alive; one whose pid a later process took (it started over a minute
        after the worker's last hand-over) is not."""
        with self._lock:
            watched = [(pid, seen) for pid, (_, seen) in self._workers.items() if pid not in connected]
        gone = [pid for pid, seen in watched if not pid_alive(pid, since=seen)]
        if not gone:
            return
        with self._lock:
            directories = set().union(*(self._workers.pop(pid, (set(), 0.0))[0] for pid in gone))
        _sweep(directories)

    def sweep_all(self, reader: int) -> None:
        """Sweep every directory: the uploader ``reader`` exits, and nobody else might. The
        marks naming it go first: with no connection left, it reads no frame that still
        needs an arena."""
        with self._lock:
            directories = set().union(*(d for d, _ in self._workers.values()))
            self._workers.clear()
        _sweep(directories, reader)


def _sweep(directories: set[str], reader: int | None = None) -> None:
    """``_arena_files.sweep_dead`` on each of ``directories``, after removing the marks that name
    uploader ``reader`` if given (a failure is logged: the next Checkpointer of a run on
    the node sweeps again)."""
    for directory in sorted(directories):
        try:
            if reader is not None:
                _arena_files.forget_reader(Path(directory), reader)
            _arena_files.sweep_dead(Path(directory))
        except Exception:  # a failed sweep leaves files, never fails a job
            logger.warning("could not sweep dead workers' snapshot arenas in %s", directory, exc_info=True)
