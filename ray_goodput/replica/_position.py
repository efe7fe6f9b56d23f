"""Where replica groups are in an epoch: pure functions over plain ints.

The position is global, as for a whole-group job (``data._partition``): ``epoch`` and
``consumed``, the samples of the epoch's permutation taken by committed steps. What
changes is the world of a step: it is ``participants`` P, the replicas in that step's
quorum, not the configured replica count. Participant ``r`` of a step at ``consumed``
reads ``[consumed + r*B, consumed + (r+1)*B)``; a committed step advances ``consumed`` by
``P*B``; a step that does not commit advances nothing (it is retried at the same position).

So the share of a replica that is down is never reserved for it: the replicas alive take
the next samples in order, and every sample of the epoch (up to the dropped tail of fewer
than ``P*B``) is read exactly once by a committed step, whatever replicas came and went.
A replacement that heals receives ``(epoch, consumed)`` with the weights, so it computes
the same slices as its peers from its first step on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_goodput.data import _partition as part
from ray_goodput.errors import ConfigError


@dataclass(frozen=True)
class Position:
    """An epoch and the samples of its permutation that committed steps consumed."""

    epoch: int = 0
    consumed: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    @staticmethod
    def from_dict(d: dict[str, int]) -> Position:
        return Position(epoch=int(d["epoch"]), consumed=int(d["consumed"]))


def step_span(pos: Position, rank: int, participants: int, batch_size: int) -> tuple[int, int]:
    """[start, stop) of participant ``rank``'s batch in the step at ``pos``. Shape: B samples."""
    part.check_world(rank, participants, batch_size)
    return part.batch_span(pos.consumed, 0, rank, participants, batch_size)


def epoch_has_step(pos: Position, num_samples: int, participants: int, batch_size: int) -> bool:
    """Whether a whole step of ``participants * batch_size`` samples is left in the epoch."""
    return part.steps_left(num_samples, pos.consumed, participants, batch_size) > 0


def after_commit(pos: Position, participants: int, batch_size: int) -> Position:
    """The position once a step of ``participants`` committed."""
    return Position(pos.epoch, part.consumed_after(pos.consumed, 1, participants, batch_size))


def next_epoch(pos: Position) -> Position:
    return Position(pos.epoch + 1, 0)


def check(pos: Position, num_samples: int) -> None:
    """Raise ConfigError when ``pos`` cannot belong to a dataset of ``num_samples``."""
    if pos.epoch < 0:
        raise ConfigError(f"replica data position has epoch={pos.epoch}; it belongs to another run")
    part.check_resume(num_samples, pos.consumed)
