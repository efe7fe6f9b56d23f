"""The step each attempt after the first resumes from, chosen once, in the driver.

``Recovery`` begins the choice when a failure is seen: a thread lists the checkpoints,
takes the newest intact committed one and pins it against retention for the generation
the next attempt will claim, beside Ray's shutdown of the old group, the placement of the
new one and its workers' start. Before it is final, the choice waits (within
``upload_wait_s``) for the saves the dead attempt's workers handed to their node uploaders
and that are still uploading: those commit without their workers, and a save seconds from
durable is worth more than the steps since the commit before it. The new group takes the
choice just before its training function starts, and looks once more: a checkpoint
committed since is newer, and is the one they resume from.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ray_goodput.checkpoint import newest_valid, next_generation, pin_resume, wait_for_uploads
from ray_goodput.runtime._resume import ResumeDecision, root_key
from ray_goodput.storage import StorageLocation

logger = logging.getLogger(__name__)

#: How long a start waits for the resume choice begun when the failure was seen, beyond
#: its wait for uploads in flight.
RESUME_CHOICE_WAIT_S = 300.0
#: How long a resume choice waits for the dead attempt's uploads in flight, by default.
UPLOAD_WAIT_S = 120.0
#: How long the run's end waits for a resume choice under way to stop (a listing of the
#: storage in it is not interrupted).
CLOSE_WAIT_S = 10.0


class ResumeChoice:
    """The resume choice of a run whose checkpoints are under ``root``: at most one under
    way, tagged with the attempt it is for. ``upload_wait_s``: how long a choice waits for
    the uploads of ``root`` still in flight in the node uploaders (0: it does not)."""

    def __init__(self, root: StorageLocation, *, upload_wait_s: float = UPLOAD_WAIT_S) -> None:
        self.root = root
        self.upload_wait_s = upload_wait_s
        self._early: tuple[int, threading.Thread, dict[str, Any]] | None = None
        self._stop = threading.Event()  # set by close(): a choice under way stops waiting

    def begin(self, attempt: int) -> None:
        """Choose ``attempt``'s resume step in a thread, unless a choice for it is under way.
        One for another attempt is dropped: that attempt's group never started (Ray failed
        the start before its training function), so nobody takes its choice."""
        if self._early is not None and self._early[0] == attempt:
            return
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: box.update(decision=self._choose(attempt)),
            name="rg-recovery-resume-choice",
            daemon=True,
        )
        thread.start()
        self._early = (attempt, thread, box)

    def drop(self) -> None:
        """Forget a choice under way: no group start follows to take it (replica mode)."""
        self._early = None

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """The run ends: a choice under way stops waiting for uploads and is waited for (up
        to ``timeout_s``), so that no thread of it is inside a Ray call while Ray shuts the
        controller down. Nothing is chosen after this."""
        self._stop.set()
        early, self._early = self._early, None
        if early is not None:
            early[1].join(timeout_s)
            if early[1].is_alive():
                logger.warning("the resume choice of attempt %d was still running at the run's end", early[0])

    def take(self, attempt: int) -> ResumeDecision | None:
        """``attempt``'s resume step, just before its training function starts: the choice
        begun for it (or one made now), then a newer checkpoint if one committed since.
        None: each worker's restore looks on its own (storage could not say in time)."""
        decision = self._taken(attempt)
        return self._newer(attempt, decision) if decision is not None else None

    def _taken(self, attempt: int) -> ResumeDecision | None:
        early, self._early = self._early, None
        if early is None or early[0] != attempt:
            return self._choose(attempt)
        _, thread, box = early
        bound = RESUME_CHOICE_WAIT_S + self.upload_wait_s  # the uploaders' answers' slack is within the first
        thread.join(timeout=bound)
        if thread.is_alive() or "decision" not in box:
            logger.warning(
                "attempt %d: the resume choice begun at the failure did not finish in %.0f s (storage %s); "
                "each worker restore will look on its own",
                attempt,
                bound,
                self.root.uri,
            )
            return None
        return box["decision"]

    def _choose(self, attempt: int) -> ResumeDecision | None:
        try:
            found = newest_valid(self.root)
        except OSError as exc:  # StorageError is an OSError: the workers will look themselves
            logger.warning(
                "attempt %d: could not list checkpoints under %s (%s); each worker restore will look on its own",
                attempt,
                self.root.uri,
                exc,
            )
            return None
        step, generation = (found[1].step, found[1].generation) if found else (None, None)
        if step is None:
            logger.info("attempt %d resumes from scratch: no committed checkpoint under %s", attempt, self.root.uri)
        else:
            logger.info("attempt %d resumes from step %d", attempt, step)
            self._pin(attempt, step)  # before any worker starts: a dead attempt's late retention must keep it
        self._wait_for_uploads(attempt, step)  # what commits meanwhile, take() finds
        return ResumeDecision(attempt=attempt, step=step, root_key=root_key(self.root), generation=generation)

    def _wait_for_uploads(self, attempt: int, step: int | None) -> None:
        """Wait, within ``upload_wait_s``, for the dead attempt's saves above ``step`` still
        uploading in the node uploaders; the work since ``step`` is redone otherwise."""
        start = time.monotonic()
        try:
            left = wait_for_uploads(self.root, above=step, timeout_s=self.upload_wait_s, stop=self._stop)
        except Exception as exc:  # noqa: BLE001 - the wait only improves the choice; never its end
            logger.warning("attempt %d: could not ask the node uploaders what they still upload: %s", attempt, exc)
            return
        waited = time.monotonic() - start
        if left:
            logger.warning(
                "attempt %d: saves still uploading after %.0f s (upload_wait_s) are not waited for: %s",
                attempt,
                waited,
                "; ".join(
                    f"node {node}: " + ("no answer" if steps is None else f"steps {steps}")
                    for node, steps in sorted(left.items())
                ),
            )
        elif waited >= 0.5:
            logger.info("attempt %d waited %.1f s for the dead attempt's uploads in flight", attempt, waited)

    def _pin(self, attempt: int, step: int) -> bool:
        """Pin ``step`` against retention for the generation ``attempt`` will claim (on a
        storage root used before, generations run ahead of this run's attempt count);
        False, logged, when storage refused."""
        try:
            pin_resume(self.root, attempt=next_generation(self.root, attempt), step=step)
        except OSError as exc:
            logger.warning("attempt %d: could not pin step %d against retention: %s", attempt, step, exc)
            return False
        return True

    def _newer(self, attempt: int, decision: ResumeDecision) -> ResumeDecision:
        """A checkpoint newer than the chosen one, by lineage (``(generation, step)``),
        committed by the dead attempt's uploaders while the new workers started (their
        processes, imports and process group: seconds), is the better resume point: it is
        pinned and handed over instead. The chosen step stands when storage cannot say."""
        try:
            found = newest_valid(self.root)
        except OSError as exc:
            logger.warning("attempt %d: could not look for a newer checkpoint (%s); it resumes as chosen", attempt, exc)
            return decision
        if found is None:
            return decision
        step, generation = found[1].step, found[1].generation
        if decision.step is not None:
            chosen = (decision.generation if decision.generation is not None else generation, decision.step)
            if (generation, step) <= chosen:
                return decision
        if not self._pin(attempt, step):
            return decision  # it resumes as chosen
        logger.info(
            "attempt %d resumes from step %d, committed while its workers started (chosen before: %s)",
            attempt,
            step,
            decision.step,
        )
        return ResumeDecision(attempt=decision.attempt, step=step, root_key=decision.root_key, generation=generation)
