"""What became of each save: the outcome every rank agrees on, the report to Ray Train, and
the failure policy for background saves.

A save that fails after its retries is logged, counted (``SaveStats``, the
``ray_goodput_checkpoint_failed_saves`` metric, the goodput ledger) and left behind once a
newer save commits: training goes on from a recovery point that is still fresh. The run
stops (:class:`~ray_goodput.errors.RecoveryPointTooOldError`, at the next outcome
agreement) only when the recovery point, the state of the newest committed checkpoint, has
grown older than ``max_recovery_point_age_s``; and ``wait()``/``close()`` raise when the
newest save failed, since nothing newer stands in for it. A save fenced by a newer run on
the same storage (:class:`~ray_goodput.errors.FencedError`) is raised at once.

Every decision is made from gathered values only (rank 0's clock and the outcomes every
rank saw), so every rank raises the same error at the same call.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ray_goodput.checkpoint.protocol import _catalog, _collective
from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.checkpoint.save._local_copies import LocalCopyDropper
from ray_goodput.checkpoint.save._ray_report import report_checkpoint
from ray_goodput.checkpoint.save._save_state import SaveRecord, SaveState, agree
from ray_goodput.checkpoint.save._schedule import SaveSchedule
from ray_goodput.checkpoint.uploader._metrics import SaveMetrics
from ray_goodput.errors import CheckpointError, FencedError, RecoveryPointTooOldError
from ray_goodput.goodput._recorder import StepRecorder
from ray_goodput.runtime import WorkerContext
from ray_goodput.storage import StorageLocation

logger = logging.getLogger(__name__)

#: The default bound on the recovery point's age: this many save intervals ...
AGE_INTERVALS = 10
#: ... and never less than this (seconds): an outage of a few minutes costs no run.
AGE_FLOOR_S = 600.0


@dataclass
class Pending:
    """A save handed off and not yet agreed on."""

    step: int
    metrics: dict[str, Any]
    handoff: Handoff
    block_seconds: float
    record: SaveRecord
    saved_at: float  # time.time() when save() began: the moment of the state it holds


@dataclass
class SaveStats:
    """Counters of this rank's saves. Seconds are wall time. Equal on every rank (as of the
    last outcome agreement), except ``last_block_seconds`` and ``total_block_seconds``:
    this rank's own time blocked, so never a condition of a collective call."""

    saves: int = 0
    failed_saves: int = 0
    committed: list[int] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    last_block_seconds: float = 0.0
    total_block_seconds: float = 0.0
    last_error: str | None = None
    #: The step of the recovery point (the newest committed checkpoint this attempt
    #: restored or saved; None: none yet) and its age when the ranks last agreed.
    recovery_step: int | None = None
    recovery_point_age_s: float = 0.0


@dataclass(frozen=True)
class _Clock:
    """Rank 0's clock, gathered with the outcomes: every rank decides on these numbers."""

    now: float
    recovery_at: float
    saved_at: dict[int, float]
    bound_s: float


def _state_of(pending: Pending, block: bool, timeout_s: float) -> tuple[str | None, str | None, FencedError | None]:
    """(SaveState value or None while running, error text, the fencing error) of this rank's part."""
    durable = pending.handoff.durable
    if not block and not durable.done():
        return None, None, None
    try:
        return durable.result(timeout=timeout_s).state.value, None, None
    except FutureTimeout:
        if durable.done():  # the job's own TimeoutError (on 3.11 it is FutureTimeout), or it ended just now
            return _ended_state(durable)
        return (
            SaveState.FAILED.value,
            f"step {pending.step} was not durable after {timeout_s:.0f}s "
            "(Checkpointer(wait_timeout_s=...)); see `ray-goodput status` for its uploader",
            None,
        )
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed across ranks
        return SaveState.FAILED.value, f"{type(exc).__name__}: {exc}", exc if isinstance(exc, FencedError) else None


def _ended_state(durable: Future) -> tuple[str, str | None, FencedError | None]:
    """:func:`_state_of` of a job that has ended."""
    exc = durable.exception(timeout=0)
    if exc is None:
        return durable.result(timeout=0).state.value, None, None
    return SaveState.FAILED.value, f"{type(exc).__name__}: {exc}", exc if isinstance(exc, FencedError) else None


def _committed_at(pending: Pending) -> float:
    """When ``pending`` became durable: its commit's time when this rank's job wrote it,
    else now (at most the time since, as a rank learns it here)."""
    durable = pending.handoff.durable
    if durable.done() and not durable.cancelled() and durable.exception() is None:
        at = getattr(durable.result(), "committed_at", None)
        if at is not None:
            return float(at)
    return time.time()


class Outcomes:
    """One rank's pending saves, and the collective that settles them (``resolve``)."""

    def __init__(
        self,
        *,
        ctx: WorkerContext,
        root: StorageLocation,
        schedule: SaveSchedule,
        recorder: StepRecorder,
        metrics: SaveMetrics | None,
        dropper: LocalCopyDropper,
        max_age_s: float | None,
    ) -> None:
        self._ctx, self._root, self._schedule = ctx, root, schedule
        self._recorder, self._metrics, self._dropper = recorder, metrics, dropper
        self._max_age_s = max_age_s
        self.pending: dict[int, Pending] = {}
        self.stats = SaveStats()
        self._recovery_at = time.time()  # nothing durable of this attempt yet: its work is at risk
        self._first_save_at: float | None = None
        self._last_save_at: float | None = None
        #: How old the recovery point may grow (seconds): ``max_recovery_point_age_s`` when
        #: set, else ``AGE_INTERVALS`` mean save intervals, at least ``AGE_FLOOR_S``. Its
        #: inputs change only in :meth:`add`, which updates it.
        self.bound_s = self._bound()
        self._reported: int | None = None
        self.reports = 0  # reports made to Ray Train (every rank alike: outcomes are agreed)
        self._newest_failed: tuple[str, BaseException | None] | None = None

    # ---- what the Checkpointer tells it ---------------------------------------------------

    def add(self, pending: Pending) -> None:
        self.pending[pending.step] = pending
        self.stats.saves += 1
        self.stats.last_block_seconds = pending.block_seconds
        self.stats.total_block_seconds += pending.block_seconds
        if self._first_save_at is None:
            self._first_save_at = pending.saved_at
        self._last_save_at = pending.saved_at
        self.bound_s = self._bound()
        if self._metrics is not None:
            self._metrics.recovery_point_age(pending.saved_at - self._recovery_at)

    def restored(self, step: int | None, at: float) -> None:
        """A restore loaded ``step`` (None: started fresh), done at ``at``: that state is durable."""
        self._recovery_at = at
        self.stats.recovery_step = step

    # ---- the policy -------------------------------------------------------------------------

    def _bound(self) -> float:
        if self._max_age_s is not None:
            return self._max_age_s
        saves = self.stats.saves
        if saves < 2 or self._first_save_at is None or self._last_save_at is None:
            return AGE_FLOOR_S
        interval = (self._last_save_at - self._first_save_at) / (saves - 1)
        return max(AGE_FLOOR_S, AGE_INTERVALS * interval)

    def age_s(self) -> float:
        """This rank's view of the recovery point's age, now."""
        return max(0.0, time.time() - self._recovery_at)

    def _clock(self) -> _Clock:
        return _Clock(
            now=time.time(),
            recovery_at=self._recovery_at,
            saved_at={s: p.saved_at for s, p in self.pending.items()},
            bound_s=self.bound_s,
        )

    # ---- agreeing on outcomes ----------------------------------------------------------------

    def resolve(self, *, block: bool, timeout_s: float) -> None:
        """Collective: agree with every rank on the outcome of each pending save; report the
        newest committed one to Ray Train, count superseded ones, record failures. Raises
        on every rank alike: FencedError when a newer run took the storage path,
        RecoveryPointTooOldError when the recovery point outgrew its bound."""
        deadline = time.monotonic() + timeout_s
        mine = {s: _state_of(p, block, max(0.0, deadline - time.monotonic())) for s, p in self.pending.items()}
        gathered = _collective.gather_tagged("save outcomes", (mine, self._schedule.proposal(), self._clock()))
        views = [v for v, _, _ in gathered]
        clock: _Clock = gathered[0][2]
        if self._schedule.adopt(gathered[0][1]):  # rank 0's proposal, adopted on every rank
            self._recorder.checkpoint_interval(self._schedule.interval_steps())
        self._recovery_at = clock.recovery_at  # rank 0's: every rank decides on the same numbers
        committed: list[tuple[int, dict[str, Any]]] = []
        fenced: FencedError | None = None
        for step in sorted(self.pending):
            seen = [v.get(step, (SaveState.FAILED.value, "this rank has no such save", None)) for v in views]
            outcome = agree([SaveState(s) for s, _, _ in seen if s is not None])
            running = any(s is None for s, _, _ in seen)
            # Only a commit is final while a rank's job still runs: a rank that gave way to a
            # newer save (or failed) after its marker was written leaves a step that another
            # rank's job can still commit.
            if running and outcome is not SaveState.COMMITTED:
                continue
            error = next((f"rank {r}: {e}" for r, (s, e, _) in enumerate(seen) if e), None)
            fenced = fenced or next((f for _, _, f in seen if f is not None), None)
            if outcome is None:  # every rank durable, none committed
                outcome, error = SaveState.FAILED, "every rank's part is durable, yet it did not commit"
            pending = self.pending.pop(step)
            self._settle(pending, outcome, error)
            if outcome is SaveState.COMMITTED:
                committed.append((step, pending.metrics))
                self._schedule.observe_durable(max(0.0, _committed_at(pending) - pending.saved_at))
                self._recovery_at = max(self._recovery_at, clock.saved_at.get(step, clock.now))
                if self.stats.recovery_step is None or step > self.stats.recovery_step:
                    self.stats.recovery_step = step  # an older step committed late is not the recovery point
        self._report(committed)
        age = max(0.0, clock.now - self._recovery_at)
        self.stats.recovery_point_age_s = age
        if self._metrics is not None:
            self._metrics.recovery_point_age(age)
        if fenced is not None:
            self._newest_failed = None  # this error is its report
            raise FencedError(str(fenced))
        if age > clock.bound_s:
            raise RecoveryPointTooOldError(
                f"the recovery point ({self._what_point()}) is {age:.1f} s old, over the bound of "
                f"{clock.bound_s:.1f} s (Checkpointer(max_recovery_point_age_s=...)); storage "
                f"{self._root.uri}; {self.stats.failed_saves} save(s) failed, the last: "
                f"{self.stats.last_error or 'none (saves are not committing in time)'}. Check the "
                "storage (`ray-goodput status`); a restart resumes from the newest committed checkpoint"
            )

    def _what_point(self) -> str:
        step = self.stats.recovery_step
        return f"committed step {step}" if step is not None else "none committed since this attempt began"

    def _settle(self, pending: Pending, outcome: SaveState, error: str | None) -> None:
        pending.record.reach(outcome, error if outcome is SaveState.FAILED else None)
        self._newest_failed = None  # a newer save's outcome replaces an older one's
        if outcome is SaveState.COMMITTED:
            self.stats.committed.append(pending.step)
        elif outcome is SaveState.SUPERSEDED:
            self.stats.superseded.append(pending.step)
            self._recorder.checkpoint_superseded(pending.step)
            logger.info("checkpoint of step %d was superseded by a newer save (not a failure)", pending.step)
        else:
            local = None
            if pending.handoff.durable.done() and not pending.handoff.durable.cancelled():
                local = pending.handoff.durable.exception()
            self._record_failure(pending.step, error or "failed", local)

    def _record_failure(self, step: int, text: str, exc: BaseException | None) -> None:
        self.stats.failed_saves += 1
        self.stats.last_error = f"step {step}: {text}"
        self._newest_failed = (self.stats.last_error, exc)
        logger.error(
            "checkpoint of step %d failed; the previous committed checkpoint stays the recovery point "
            "(the run goes on while it is younger than its bound): %s",
            step,
            text,
        )
        self._recorder.checkpoint_failed(step)
        if self._metrics is not None:
            self._metrics.failed()

    def _report(self, committed: list[tuple[int, dict[str, Any]]]) -> None:
        """Report the newest of ``committed`` to Ray Train, with its metrics: one report per
        agreement, not one per commit. Ray's controller takes one report per poll
        (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default) and a worker holds at most
        one unread, so each extra report held the training loop until the next poll."""
        if not committed:
            return
        newest, metrics = max(committed, key=lambda c: c[0])
        if self._reported is None or newest > self._reported:  # Ray Train's newest stays the newest
            self._reported = newest
            if self._ctx.in_ray_train:
                self.reports += 1
                report_checkpoint(self._ctx, _catalog.step_location(self._root, newest), {**metrics, "step": newest})
        if newest == self.stats.recovery_step:  # not an older step that committed late
            self._recorder.recovery_point(newest, self._recovery_at)
        self._dropper.drop_older(newest, keep=self.pending)

    def raise_if_newest_failed(self) -> None:
        """After every save is settled: CheckpointError when the newest one failed (nothing
        newer committed to stand in for it); raised once."""
        if self._newest_failed is None:
            return
        (text, exc), self._newest_failed = self._newest_failed, None
        raise CheckpointError(f"the newest checkpoint save failed and nothing newer committed: {text}") from exc
