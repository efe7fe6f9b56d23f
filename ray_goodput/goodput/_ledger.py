"""The goodput ledger: every second of a job in exactly one bucket. Pure functions.

Input: each attempt's events (one attempt = one worker-group run, as recorded by rank 0).
Buckets (named after the ml-goodput-measurement taxonomy where they match):

- ``productive``: steps whose results were kept,
- ``degraded``: in replica mode, the share of kept steps' time that missing replicas would
  have computed (a step of P of R configured replicas is P/R productive): capacity lost
  while a replica was replaced, not time,
- ``lost``: steps computed after the checkpoint a later attempt resumed from, or a
  ``restore()`` later in the same attempt loaded (redone), and in replica mode a step's
  try that did not commit (a peer died in it; retried),
- ``checkpoint_stall``: the loop blocked by ``Checkpointer.save``,
- ``data_stall``: the loop waiting for a batch,
- ``restore``: loading a checkpoint,
- ``restart_downtime``: from an attempt's last sign of life to the next attempt's first
  step (detection, teardown, rescheduling, process and model setup); in replica mode also
  a step's wait in its quorum when the replicas in it changed (a dead peer's heartbeat
  timing out, a replacement joining and healing from this replica),
- ``startup``: from job start to the first attempt's first step (with, in replica mode,
  its first quorum's wait for every replica),
- ``other``: everything else (e.g. waiting for uploads at the end, evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BUCKETS = (
    "productive",
    "degraded",
    "lost",
    "checkpoint_stall",
    "data_stall",
    "restore",
    "restart_downtime",
    "startup",
    "other",
)


@dataclass
class Ledger:
    """Seconds per bucket; ``total`` is job wall time (``end - start``)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    start: float = 0.0
    end: float = 0.0
    attempts: int = 0
    failures: int = 0
    steps_kept: int = 0
    steps_lost: int = 0
    #: The kept steps this job computed, each weighted by the share of the configured
    #: replicas that computed it (replica mode; 1 otherwise): full-capacity steps of work,
    #: whatever a step's duration. ``work_steps / total`` compares systems whose steps take
    #: different times, which goodput (a share of time) does not.
    work_steps: float = 0.0
    checkpoints_superseded: int = 0
    checkpoints_failed: int = 0
    #: Age of the newest committed checkpoint's state at the end (None: none committed),
    #: and the oldest it grew during the job (a storage outage shows here).
    recovery_point_age_s: float | None = None
    recovery_point_age_max_s: float | None = None
    checkpoint_interval_steps: int | None = None
    finished: bool = False

    @property
    def total(self) -> float:
        return self.end - self.start

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.total if self.total > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        out = {f"goodput/{k}_s": v for k, v in self.seconds.items()}
        out.update(
            {
                "goodput/goodput": self.goodput,
                "goodput/total_s": self.total,
                "goodput/attempts": self.attempts,
                "goodput/failures": self.failures,
                "goodput/steps_kept": self.steps_kept,
                "goodput/steps_lost": self.steps_lost,
                "goodput/work_steps": self.work_steps,
                "goodput/checkpoints_superseded": self.checkpoints_superseded,
                "goodput/checkpoints_failed": self.checkpoints_failed,
            }
        )
        if self.recovery_point_age_s is not None and self.recovery_point_age_max_s is not None:
            out["goodput/recovery_point_age_s"] = self.recovery_point_age_s
            out["goodput/recovery_point_age_max_s"] = self.recovery_point_age_max_s
        if self.checkpoint_interval_steps is not None:
            out["goodput/checkpoint_interval_steps"] = self.checkpoint_interval_steps
        return out


def _first_progress(events: list[dict[str, Any]]) -> float | None:
    """When the attempt's first step, or first try of one that did not commit, began."""
    return next((e["t0"] for e in events if e["e"] in ("step", "uncommitted")), None)


def _lowest_restore(events: list[dict[str, Any]]) -> int:
    """The lowest step an attempt loaded, at its start or in a rollback later (0: none, or
    from scratch): the attempts before it keep their steps up to there."""
    return min(((e.get("step") or 0) for e in events if e["e"] == "restore"), default=0)


def _reached(events: list[dict[str, Any]]) -> int:
    """Where an attempt's training stood at its last event: its last step, or the step its
    last restore loaded when no step came after it (a rollback, or a resume)."""
    at = 0
    for e in events:
        if e["e"] in ("restore", "step"):
            at = e.get("step") or 0
    return at


def _got_anywhere(events: list[dict[str, Any]]) -> bool:
    """Whether an attempt restored or stepped: one that died before either (in its restore,
    say) says nothing about which steps of the attempts before it were kept."""
    return any(e["e"] in ("restore", "step") for e in events)


def keep_limits(events: list[dict[str, Any]], keep_upto: int | None) -> list[int | None]:
    """For each event of an attempt, the last step of it that is kept (None: all): at most
    ``keep_upto`` (a later attempt's resume or rollback, :func:`kept_upto`), and at most the
    lowest step a restore later in the attempt loaded. Such a rollback (``restore`` of an
    older step after a loss spike; in replica mode, replica 0's replacement restoring the
    checkpoint when no peer had progress) redoes the steps above it; a heal to a peer's
    step, at or above every step before it, keeps them all."""
    out: list[int | None] = []
    lowest = keep_upto
    for e in reversed(events):
        out.append(lowest)
        if e["e"] == "restore":
            step = e.get("step") or 0
            lowest = step if lowest is None else min(lowest, step)
    return out[::-1]


def _account_steps(ledger: Ledger, events: list[dict[str, Any]], keep_upto: int | None, *, first_attempt: bool) -> None:
    """Add an attempt's steps (``first_attempt``: the job's first), each kept up to its
    :func:`keep_limits`."""
    last = 0
    for e, limit in zip(events, keep_limits(events, keep_upto)):
        if e["e"] == "uncommitted":  # replica mode: a try of a step that was then retried
            ledger.seconds["lost"] += max(0.0, e["t"] - e["t0"])
            continue
        if e["e"] != "step":
            continue
        fetch, ckpt, wait = e.get("fetch", 0.0), e.get("ckpt", 0.0), e.get("wait", 0.0)
        ledger.seconds["startup" if first_attempt and last == 0 else "restart_downtime"] += wait
        work = max(0.0, e["t"] - e["t0"] - fetch - ckpt - wait)
        n = max(1, int(e.get("n", 1)))
        first = e["step"] - n + 1
        kept_steps = n if limit is None else max(0, min(n, limit - first + 1))
        kept = work * kept_steps / n
        capacity = min(1.0, max(0.0, float(e.get("capacity", 1.0))))  # replica mode: P of R replicas
        ledger.seconds["productive"] += kept * capacity
        ledger.seconds["degraded"] += kept * (1.0 - capacity)
        ledger.work_steps += kept_steps * capacity
        ledger.seconds["lost"] += work * (n - kept_steps) / n
        ledger.steps_lost += n - kept_steps
        ledger.seconds["data_stall"] += fetch
        ledger.seconds["checkpoint_stall"] += ckpt
        last = e["step"]


def compute(
    attempts: list[list[dict[str, Any]]], *, job_start: float | None = None, job_end: float | None = None
) -> Ledger:
    """The ledger of a job from its attempts' events (each list sorted by time)."""
    attempts = sorted((a for a in attempts if a), key=lambda a: a[0]["t"])
    ledger = Ledger(attempts=len(attempts), failures=max(0, len(attempts) - 1))
    if not attempts:
        return ledger
    ledger.start = min(job_start or attempts[0][0]["t"], attempts[0][0]["t"])
    ledger.end = max(job_end or 0.0, attempts[-1][-1]["t"])
    ledger.finished = any(e["e"] == "end" for e in attempts[-1])
    ledger.checkpoints_superseded = sum(e["e"] == "ckpt_superseded" for a in attempts for e in a)
    ledger.checkpoints_failed = sum(e["e"] == "ckpt_failed" for a in attempts for e in a)
    _recovery_point_ages(ledger, [e for a in attempts for e in a if e["e"] == "recovery_point"])
    ledger.checkpoint_interval_steps = next(
        (e["steps"] for a in reversed(attempts) for e in reversed(a) if e["e"] == "ckpt_interval"), None
    )
    prev_end = ledger.start
    for i, events in enumerate(attempts):
        keep_upto = kept_upto(attempts, i)
        first = _first_progress(events) or events[-1]["t"]
        restore = sum(e["t"] - e["t0"] for e in events if e["e"] == "restore")
        ledger.seconds["restore"] += restore
        # From the previous attempt's last sign of life to this one's first step (or try of
        # one), less the restore before it (replica mode also restores later: a heal).
        restore_first = sum(e["t"] - e["t0"] for e in events if e["e"] == "restore" and e["t"] <= first)
        gap = max(0.0, first - prev_end - restore_first)
        ledger.seconds["startup" if i == 0 else "restart_downtime"] += gap
        _account_steps(ledger, events, keep_upto, first_attempt=i == 0)
        if keep_upto is None and _got_anywhere(events):
            ledger.steps_kept = _reached(events)
        prev_end = events[-1]["t"]
    ledger.seconds["other"] = max(0.0, ledger.total - sum(v for k, v in ledger.seconds.items() if k != "other"))
    return ledger


def kept_upto(attempts: list[list[dict[str, Any]]], i: int) -> int | None:
    """The last step of attempt ``i`` (of ``attempts``, sorted by time) whose result was kept:
    the lowest step a later attempt that got anywhere loaded, at its resume or in a rollback
    (one may resume below another: its pick was damaged and it fell back to an older one);
    None (all of them) when no later attempt got anywhere."""
    later = [_lowest_restore(a) for a in attempts[i + 1 :] if _got_anywhere(a)]
    return min(later) if later else None


def _recovery_point_ages(ledger: Ledger, points: list[dict[str, Any]]) -> None:
    """The recovery point's age at the job's end, and the most it reached: just before each
    newer commit landed, and at the end."""
    if not points:
        return
    points = sorted(points, key=lambda e: e["t"])
    ages = [b["t"] - a["at"] for a, b in zip(points, points[1:])]
    ledger.recovery_point_age_s = max(0.0, ledger.end - points[-1]["at"])
    ledger.recovery_point_age_max_s = max([ledger.recovery_point_age_s, *ages])


def fetch_stats(events: list[dict[str, Any]], since: float = 0.0) -> dict[str, float]:
    """p50, p95 and max of the per-step data wait (``fetch`` seconds) of the step events
    that ended after ``since``; empty when there are none."""
    waits = sorted(e.get("fetch", 0.0) for e in events if e["e"] == "step" and e["t"] > since)
    if not waits:
        return {}
    pick = lambda q: waits[min(len(waits) - 1, int(q * len(waits)))]  # noqa: E731 - nearest rank
    return {
        "data/fetch_seconds_p50": pick(0.5),
        "data/fetch_seconds_p95": pick(0.95),
        "data/fetch_seconds_max": waits[-1],
    }
