"""Fault injection that kills real processes, once, at a chosen point."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no atexit, no flush, as a real crash."""
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FailAt:
    """Kill the process at ``step`` on ``rank``, once per ``marker_dir`` (a restarted
    worker group passes the same step again without dying).

    ``or_later``: kill at the first step at or after ``step`` that ``rank`` reaches. A
    schedule counted in steps of work needs it in replica mode: a replica being replaced
    while the others step past ``step`` would otherwise never meet that failure (its
    replacement heals to a later step); with ``or_later`` the replacement dies at its first
    step, and each scheduled failure is met once.

    ``marker_dir`` must be shared by all attempts (a path on the same machine or a
    shared filesystem).
    """

    step: int
    rank: int
    marker_dir: str
    name: str = "fault"
    or_later: bool = False

    def _marker(self) -> Path:
        return Path(self.marker_dir) / f"{self.name}-step{self.step}-rank{self.rank}.fired"

    @property
    def fired(self) -> bool:
        return self._marker().exists()

    def maybe_fail(self, step: int, rank: int) -> None:
        """Call once per step; kills this process the first time (step, rank) match."""
        due = step >= self.step if self.or_later else step == self.step
        if not due or rank != self.rank or self.fired:
            return
        self._marker().parent.mkdir(parents=True, exist_ok=True)
        self._marker().write_text(str(os.getpid()))
        logger.warning("fault injection: killing rank %d (pid %d) at step %d", rank, os.getpid(), step)
        kill_self()
