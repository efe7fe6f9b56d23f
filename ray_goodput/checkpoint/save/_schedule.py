"""When ``Checkpointer.maybe_save`` saves: every N steps, or at the planned interval.

``every="auto"`` uses :class:`ray_goodput.plan.AutoInterval`: each rank measures its step
and save-blocking times, but only rank 0's proposal counts, and every rank adopts it at
the same outcome agreement (a gather the Checkpointer already makes: at ``wait()``,
every ``sync_every``-th save, and at each of the first ``WARMUP_SYNCS`` saves so that the
interval settles early). Between agreements ``due`` reads only the adopted interval and
the step counters, which are equal on every rank, so every rank saves the same steps.
"""

from __future__ import annotations

import logging
from typing import Literal

from ray_goodput.errors import ConfigError
from ray_goodput.plan import AutoInterval

logger = logging.getLogger(__name__)

#: Saves after which an "auto" schedule syncs, so the measured interval is in force soon.
WARMUP_SYNCS = 3


class SaveSchedule:
    """``every``: None (only explicit ``save``), an int >= 1 (every N steps) or "auto";
    ``sync_every``: saves between outcome agreements (see :meth:`after_save`)."""

    def __init__(
        self, every: int | Literal["auto"] | None, *, world_size: int, mtbf_hours: float | None, sync_every: int = 8
    ) -> None:
        self.every = every
        self.sync_every = sync_every
        self._auto: AutoInterval | None = None
        if every == "auto":
            self._auto = AutoInterval(world_size=world_size, mtbf_hours=mtbf_hours)
        elif every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ConfigError(f"every must be an int >= 1, 'auto' or None, got {every!r}")
        if mtbf_hours is not None and self._auto is None:
            raise ConfigError("mtbf_hours only applies with every='auto'; drop it or set every='auto'")

    def interval_steps(self) -> int | None:
        """The interval in force, in steps (None without a schedule)."""
        return self._auto.interval_steps() if self._auto else self.every  # type: ignore[return-value]

    def observe_step(self, seconds: float) -> None:
        if self._auto:
            self._auto.observe_step(seconds)

    def after_save(self, blocking_s: float, *, saves_done: int) -> bool:
        """A save blocked the loop ``blocking_s``; ``saves_done`` saves are made. Returns
        whether the next save first agrees the outcomes so far (and the interval): every
        ``sync_every``-th save, and each of the first ``WARMUP_SYNCS`` with "auto". A count
        of saves only, so every rank syncs at the same save."""
        if self._auto:
            self._auto.observe_save(blocking_s)
        return saves_done % self.sync_every == 0 or (self._auto is not None and 0 < saves_done <= WARMUP_SYNCS)

    def observe_durable(self, seconds: float) -> None:
        """A save of this rank committed ``seconds`` after it started."""
        if self._auto:
            self._auto.observe_durable(seconds)

    def due(self, step: int, last_saved_step: int | None) -> bool:
        """Whether ``step`` is due (``last_saved_step``: the last save or the restored step)."""
        if self.every is None:
            raise ConfigError("maybe_save needs a schedule: Checkpointer(every=N) or every='auto'")
        if self._auto:
            return self._auto.due(step, last_saved_step)
        return step - (last_saved_step or 0) >= self.every

    def proposal(self) -> int | None:
        """This rank's proposed interval (only rank 0's is adopted)."""
        return self._auto.proposal() if self._auto else None

    def adopt(self, steps: int | None) -> bool:
        """Put rank 0's proposal in force; True when the interval changed."""
        return bool(self._auto and steps is not None and self._auto.adopt(steps))
