"""A rank's two snapshot arenas: which one a save copies into, and the first made ready
ahead of the first save.

A save copies into an arena that no job holds; while one job is written from an arena and
another waits in the other, a third save supersedes the waiting one (the newest state goes
next) by claiming its snapshot (``_arena_files.claim``) and copies into its arena at once: the
decision is the worker's alone, never a question to the uploader. Arena 0 is sized and touched
(pinned on a GPU) in a background thread before the first save needs it (``_first_save``):
from ``restore()``, or for a fresh start from its optimizers' first step. The other arena is
touched in the background once a save used the first: saves that wait for their uploads
never need it, and the first save that does (saves faster than uploads) would pay every
page's first touch on the training thread.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from ray_goodput.checkpoint.save._arena import Arena
from ray_goodput.checkpoint.save._arena_files import arena_names, claim, held_for_a_job, pick_dir, sweep_dead
from ray_goodput.checkpoint.save._first_save import after_first_steps, snapshot_device, snapshot_size
from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.errors import CheckpointError

logger = logging.getLogger(__name__)

# Bound on a wait for the release of an arena after the uploader started the waiting job
# (the older one ended, so its release is on its way; immediate unless the uploader is
# wedged).
_ARENA_WAIT_S = 600.0
# Bound on a wait for the background preparation of arena 0 (touching, pinning).
_PREPARE_WAIT_S = 60.0


class ArenaPair:
    """The two arenas of one rank of one run, in ``staging``'s memory file system."""

    def __init__(self, staging: Path, run_key: str, rank: int, world_size: int) -> None:
        self._staging, self._run_key = staging, run_key
        self._rank, self._world_size = rank, world_size
        self.arenas: list[Arena] = []  # none until sized (by a save, or ahead of the first)
        self._holders: list[Handoff | None] = [None, None]
        self._order = [0, 0]  # when each arena's holder was handed over (the newer: higher)
        self._handed = itertools.count(1)
        self._preparing: dict[int, threading.Thread] = {}  # arenas being touched (pinned) ahead of use
        self._touched: set[int] = set()  # arenas touched ahead, or by a snapshot
        self._first_steps: list[Any] = []  # hooks that size arena 0 after a fresh start's first step
        self._closed = False

    # -- ahead of the first save --
    def prepare(self, state: dict[str, Any]) -> None:
        """Size arena 0 for ``state`` and touch (and pin) its pages in the background; for
        a fresh start, right after its optimizers' first step. Never raises: it runs at the
        end of ``restore()``, which must return on every rank, and inside a step."""
        self.stop_watching_steps()
        if not self._size_first(state):  # a fresh start: sized after its optimizers' first step
            self._first_steps = after_first_steps(state, functools.partial(self._size_first, state))

    def _size_first(self, state: dict[str, Any]) -> bool:
        """False only when ``state`` cannot be sized yet (an optimizer that never stepped);
        True when done or nothing is to be done."""
        if self.arenas or self._closed:
            return True
        try:
            size = snapshot_size(state, self._world_size, self._rank)
            if not size:
                return False
            arenas = self._new(size)
            self.arenas = arenas
            self._prefault(0, size, snapshot_device(state))
        except Exception as exc:  # noqa: BLE001 - an optimisation: the save sizes the arena itself
            logger.warning("could not prepare the first save's snapshot arena: %s", exc)
        return True

    def _prefault(self, index: int, size: int, device: Any) -> None:
        """Touch (and pin) arena ``index`` for ``size`` bytes in a background thread."""
        thread = threading.Thread(
            target=self.arenas[index].prefault, args=(size, device), name="rg-arena-prefault", daemon=True
        )
        self._touched.add(index)
        self._preparing[index] = thread
        thread.start()

    def stop_watching_steps(self) -> None:
        """Remove the first-step hooks (before a save's or restore's made-up steps; never
        from inside ``step()``, see ``after_first_steps``)."""
        for handle in self._first_steps:
            handle.remove()
        self._first_steps = []

    def wait_prepared(self, index: int | None = None) -> None:
        """Wait for the background preparation of arena ``index`` (None: of both; milliseconds,
        seconds to pin GBs on a GPU; bounded): an arena is not thread-safe, and a snapshot
        must not be copied under its zeros."""
        for i in [index] if index is not None else list(self._preparing):
            thread = self._preparing.get(i)
            if thread is None:
                continue
            thread.join(_PREPARE_WAIT_S)
            if thread.is_alive():
                raise CheckpointError(
                    f"touching (and pinning) the snapshot arena's pages took over "
                    f"{_PREPARE_WAIT_S:.0f}s; is the node out of memory?"
                )
            del self._preparing[i]

    # -- a save --
    def take(self, need_bytes: int, *, step_of: Callable[[Handoff], int]) -> tuple[int, Arena]:
        """``(index, arena)`` of an arena no job holds, for ``need_bytes``. When both are
        held (one being written, one waiting), the waiting job (the one handed over last,
        whatever its save's fate; ``step_of`` names its step in the log) is superseded by
        claiming its snapshot before the uploader starts reading it; its arena is free at
        once. Only when the uploader claimed it first (it started: the
        older job has ended) does this wait, for the older arena's release, already sent
        (bounded)."""
        index = self._pick(need_bytes, step_of)
        self.wait_prepared(index)
        self._touched.add(index)  # by the snapshot about to be copied into it
        return index, self.arenas[index]

    def _pick(self, need_bytes: int, step_of: Callable[[Handoff], int]) -> int:
        if not self.arenas:
            self.arenas = self._new(need_bytes)
        free = [i for i, h in enumerate(self._holders) if h is None or h.released.done()]
        if free:
            return free[0]
        newer = max((0, 1), key=lambda i: self._order[i])
        if claim(self.arenas[newer].path, self._holders[newer].key):
            logger.info(
                "superseding the waiting save of step %d: a newer save came before it started",
                step_of(self._holders[newer]),
            )
            return newer
        done, _ = wait_futures([h.released for h in self._holders], timeout=_ARENA_WAIT_S, return_when=FIRST_COMPLETED)
        if not done:
            raise CheckpointError(
                f"no snapshot arena was released by the uploader within {_ARENA_WAIT_S:.0f}s; "
                "check the uploader's health (ray-goodput status)"
            )
        return next(i for i, h in enumerate(self._holders) if h.released in done)

    def hold(self, index: int, handoff: Handoff) -> None:
        """Arena ``index`` is the job's until ``handoff.released``; the other arena, never
        used yet, is touched (and pinned like this one) in the background."""
        self._holders[index] = handoff
        self._order[index] = next(self._handed)
        other, used = 1 - index, self.arenas[index]
        if other not in self._touched and not self._closed:
            self._prefault(other, used.size, used.device if used.pinned else None)

    def _new(self, need_bytes: int) -> list[Arena]:
        base = pick_dir(self._staging, 2 * need_bytes) / self._run_key
        fallback = self._staging / self._run_key  # when /dev/shm fills up with the other ranks'
        for directory in {base, fallback}:  # a dead worker's arena may have moved there
            sweep_dead(directory)
        return [Arena(base / name, fallback) for name in arena_names(self._rank)]

    def close(self) -> None:
        """Unlink both arenas (jobs that accepted a snapshot keep their own mapping). One
        still being prepared after the bound is left to its thread (swept once this process
        is gone): it may be pinning it. One a job not mapped yet still needs (its mark) is
        left for that job, and swept once the job let go and this process is gone."""
        self._closed = True
        self.stop_watching_steps()
        busy = set()
        for index, thread in self._preparing.items():
            thread.join(_PREPARE_WAIT_S)
            if thread.is_alive():
                busy.add(index)
                logger.warning(
                    "the snapshot arena %s was still being prepared after %.0fs; left in place",
                    self.arenas[index].path,
                    _PREPARE_WAIT_S,
                )
        for index, arena in enumerate(self.arenas):
            if index in busy:
                continue
            if held_for_a_job(arena.path):
                # A save that returned, its job unread in the uploader's socket or held in
                # a file: the uploader maps it later, and the sweeps (the uploader's, the
                # next worker's) remove it once that job let go and this process is gone.
                logger.warning("the snapshot arena %s is left for a job no uploader has mapped yet", arena.path)
                arena.close(keep_file=True)
            else:
                arena.close()
