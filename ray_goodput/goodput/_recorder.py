"""Per-process step recorder: what the training loop feeds the goodput ledger.

The Checkpointer and the data loader feed it automatically; a loop of your own calls
:func:`record_step` once per step. Recording is an in-memory update plus one local
``write()`` (or a buffered append on object stores): no barrier, no round trip.
"""

from __future__ import annotations

import logging
import threading
import time

from ray_goodput.goodput._events import EventLog
from ray_goodput.runtime import WorkerContext

logger = logging.getLogger(__name__)


class StepRecorder:
    """Turns step boundaries, stalls and restores into events of an :class:`EventLog`.

    ``log`` is None on ranks other than 0 (their timeline is rank 0's) and outside Ray
    Train; then every method is a cheap no-op.
    """

    def __init__(self, log: EventLog | None) -> None:
        self.log = log
        self._lock = threading.Lock()
        self._mark = time.time()
        self._last_step: int | None = None
        self._fetch = 0.0
        self._ckpt = 0.0
        self.explicit = False
        self._ended = False  # after the end, every event is pushed at once (see _flush_if_ended)

    def add_fetch(self, seconds: float) -> None:
        """Time the loop waited for a batch (data stall), counted in the current step."""
        with self._lock:
            self._fetch += seconds

    def add_checkpoint_stall(self, seconds: float) -> None:
        """Time the loop was blocked by a checkpoint save, counted in the current step."""
        with self._lock:
            self._ckpt += seconds

    def checkpoint_interval(self, steps: int | None) -> None:
        """The checkpoint interval in force changed to ``steps`` (``every="auto"``)."""
        if self.log is not None and steps is not None:
            self.log.emit("ckpt_interval", steps=steps)

    def restored(self, step: int | None, t0: float, t1: float) -> None:
        """A restore took [t0, t1] and resumed after ``step`` (None: from scratch)."""
        with self._lock:
            self._last_step, self._mark = step, t1
            self._fetch = self._ckpt = 0.0
        if self.log is not None:
            self.log.emit("restore", step=step, t0=t0, t=t1)

    def checkpoint_superseded(self, step: int) -> None:
        """The checkpoint of ``step`` was dropped for a newer one before it was written."""
        if self.log is not None:
            self.log.emit("ckpt_superseded", step=step, t=time.time())
            self._flush_if_ended()

    def checkpoint_failed(self, step: int) -> None:
        """The checkpoint of ``step`` failed after its retries (the run goes on)."""
        if self.log is not None:
            self.log.emit("ckpt_failed", step=step, t=time.time())
            self._flush_if_ended()

    def recovery_point(self, step: int, at: float) -> None:
        """The newest committed checkpoint is now ``step``, holding the state as of ``at``."""
        if self.log is not None:
            self.log.emit("recovery_point", step=step, at=at, t=time.time())
            self._flush_if_ended()

    def step(
        self,
        step: int,
        *,
        fetch_seconds: float = 0.0,
        explicit: bool = True,
        capacity: float = 1.0,
        wait_seconds: float = 0.0,
    ) -> None:
        """Step ``step`` just finished: everything since the previous mark belongs to it.
        Replica mode: ``capacity`` is the share of the configured replicas that computed it,
        ``wait_seconds`` its wait in a quorum whose replicas changed (not work)."""
        now = time.time()
        with self._lock:
            if explicit:
                self.explicit = True
            elif self.explicit:
                return  # the loop records its own steps; don't double count
            prev = self._last_step if self._last_step is not None else 0
            event = {
                "step": step,
                "n": max(1, step - prev),
                "t0": self._mark,
                "t": now,
                "fetch": self._fetch + fetch_seconds,
                "ckpt": self._ckpt,
            }
            if capacity < 1.0:
                event["capacity"] = capacity
            if wait_seconds > 0:
                event["wait"] = wait_seconds
            self._mark, self._last_step = now, step
            self._fetch = self._ckpt = 0.0
        if self.log is not None:
            self.log.emit("step", **event)

    def uncommitted(self) -> None:
        """Replica mode: the step since the previous mark did not commit (a peer failed in
        it) and is tried again: its time is lost work, not the retry's."""
        now = time.time()
        with self._lock:
            t0, self._mark = self._mark, now
            self._fetch = self._ckpt = 0.0
        if self.log is not None:
            self.log.emit("uncommitted", t0=t0, t=now)

    def end(self) -> None:
        """The training function finished cleanly."""
        self._ended = True
        if self.log is not None:
            self.log.emit("end")
            self.log.flush()
            self.log.stop_spooling()  # its files would stay behind: nothing closes the log

    def _flush_if_ended(self) -> None:
        """Events after the end (the last commit, settled by ``close()``) go to storage at
        once: the process may exit before the next periodic flush, and the final ledger
        is read right after them."""
        if self._ended and self.log is not None:
            self.log.flush()


_RECORDER: StepRecorder | None = None
_RECORDER_LOCK = threading.Lock()


def _make() -> StepRecorder:
    ctx = WorkerContext.detect()
    root = ctx.run_root
    if root is None or ctx.rank != 0:  # outside Ray Train, or not the timeline's rank
        return StepRecorder(None)
    try:
        return StepRecorder(EventLog(root, rank=ctx.rank, world_size=ctx.world_size))
    except Exception as exc:  # noqa: BLE001 - accounting must never break training
        logger.warning("goodput events disabled: %s", exc)
        return StepRecorder(None)


def get_recorder() -> StepRecorder:
    """This process's recorder (created on first use)."""
    global _RECORDER  # noqa: PLW0603 - one per process, like the Ray Train context
    with _RECORDER_LOCK:
        if _RECORDER is None:
            _RECORDER = _make()
        return _RECORDER


def record_step(step: int, *, fetch_seconds: float = 0.0) -> None:
    """Record that training step ``step`` finished; call once per step, on every rank
    (only rank 0's record is kept). ``fetch_seconds``: time this step waited for data,
    if your loader is not ``ray_goodput.data.DataLoader`` (which reports it itself)."""
    get_recorder().step(step, fetch_seconds=fetch_seconds)


def record_end() -> None:
    """Mark the clean end of the training function (``Checkpointer.close`` does it)."""
    get_recorder().end()
