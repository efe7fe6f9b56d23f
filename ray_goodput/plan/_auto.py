"""The decision core of ``Checkpointer(every="auto")``: when is the next save due?

Every rank must save the same steps (a save is collective), but each rank measures its
own step and save times. So the decision is split in two:

- ``proposal()`` is a rank-local opinion: Daly's optimal interval (see
  :func:`ray_goodput.plan.optimal_interval_s`) from the median of this rank's recent step
  times and save blocking times and the job MTBF, as a whole number of steps. Only rank 0's
  proposal is used.
- ``adopt(steps)`` sets the interval in force. The Checkpointer calls it on every rank with
  rank 0's proposal, shared by a broadcast the save already does (one small int, no extra
  collective). ``due(step, last_saved)`` then reads only the interval in force and the step
  counters, which are equal on every rank, so every rank answers the same.

Until the first adopt, the interval in force is ``warmup_steps`` (a constant, equal on all
ranks). With the proposal piggybacked on the broadcast at the *start* of a save, the first
save (at ``warmup_steps``) carries no save cost yet, so its proposal keeps ``warmup_steps``;
the second save carries the first save's cost, and from then on the optimum is in force.
A restart begins a fresh instance (measurements are per attempt); the restart time does
not move the optimum (Daly), so it is not an input.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

from ray_goodput.errors import ConfigError
from ray_goodput.plan import _formulas as f

logger = logging.getLogger(__name__)


class AutoInterval:
    """Measured costs in, a save interval in whole steps out. Not thread-safe; one per rank.

    ``world_size`` is the number of GPUs (ranks) the job's MTBF scales with; ``mtbf_hours``
    overrides ``8760 / (world_size * afr)``. Proposals within ``min_change`` (relative) of
    the interval in force keep it, so noise in the medians does not flap the interval.
    """

    def __init__(
        self,
        *,
        world_size: int,
        mtbf_hours: float | None = None,
        afr: float = 0.01,
        warmup_steps: int = 10,
        window: int = 32,
        min_change: float = 0.1,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ConfigError(f"warmup_steps must be an int >= 1, got {warmup_steps!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"window must be an int >= 1, got {window!r}")
        hours = f.mtbf_hours(world_size, afr) if mtbf_hours is None else f.positive("mtbf_hours", mtbf_hours)
        self.mtbf_s = hours * 3600.0
        self.min_change = f.positive("min_change", min_change, zero_ok=True)
        self.warmup_steps = warmup_steps
        self._steps: deque[float] = deque(maxlen=window)
        self._saves: deque[float] = deque(maxlen=max(1, window // 4))
        self._durable: deque[float] = deque(maxlen=max(1, window // 4))
        self._steps_in_force = warmup_steps

    def observe_step(self, seconds: float) -> None:
        """One training step's duration, excluding any save blocking inside it."""
        self._steps.append(f.positive("step seconds", seconds, zero_ok=True))

    def observe_save(self, blocking_s: float) -> None:
        """How long one save blocked the loop on this rank."""
        self._saves.append(f.positive("save blocking seconds", blocking_s, zero_ok=True))

    def observe_durable(self, seconds: float) -> None:
        """How long one save took from its start to committed (its time to durable)."""
        self._durable.append(f.positive("durable seconds", seconds, zero_ok=True))

    @property
    def durable_s(self) -> float | None:
        return statistics.median(self._durable) if self._durable else None

    @property
    def step_s(self) -> float | None:
        return statistics.median(self._steps) if self._steps else None

    @property
    def save_s(self) -> float | None:
        return statistics.median(self._saves) if self._saves else None

    def _costs(self) -> tuple[float, float | None] | None:
        """(save blocking, time to durable) as the formulas take them; None before any save."""
        if self.save_s is None:
            return None
        save = max(self.save_s, 1e-6)
        return save, None if self.durable_s is None else max(self.durable_s, save)

    def optimal_interval_s(self) -> float | None:
        """Daly's optimum in compute seconds from this rank's measurements, never below the
        measured upload (time to durable less the blocking); None before any save."""
        costs = self._costs()
        return None if costs is None else f.optimal_interval_s(costs[0], self.mtbf_s, durable_s=costs[1])

    def proposal(self) -> int:
        """This rank's interval in steps; the interval in force until both costs are measured."""
        seconds, step = self.optimal_interval_s(), self.step_s
        if seconds is None or not step:
            return self._steps_in_force
        save, durable = self._costs()  # as optimal_interval_s took them: its floor is this upload
        upload = 0.0 if durable is None else durable - save
        steps = f.interval_steps(seconds, step, at_least_s=upload)
        near = abs(steps - self._steps_in_force) <= self.min_change * self._steps_in_force
        if near and self._steps_in_force * step >= upload:  # never kept below the upload either
            return self._steps_in_force
        return steps

    def adopt(self, steps: int) -> bool:
        """Put rank 0's proposal in force on this rank; True when the interval changed."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"interval steps must be an int >= 1, got {steps!r}")
        changed, self._steps_in_force = steps != self._steps_in_force, steps
        if changed:
            logger.info(
                "checkpoint interval now %d steps (step %.3gs, save blocks %.3gs, durable after %.3gs, MTBF %.3gh)",
                steps,
                self.step_s or 0.0,
                self.save_s or 0.0,
                self.durable_s or 0.0,
                self.mtbf_s / 3600.0,
            )
        return changed

    def interval_steps(self) -> int:
        """The interval in force, in steps (>= 1); equal on all ranks after each adopt."""
        return self._steps_in_force

    def due(self, step: int, last_saved_step: int | None) -> bool:
        """Whether ``step`` should be saved. ``last_saved_step``: the last save of this
        attempt, or the restored step, or None at the start of a fresh run (counts from 0)."""
        return step - (last_saved_step or 0) >= self._steps_in_force
