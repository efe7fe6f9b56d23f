"""The life of one save as named states, advanced in one place.

```
snapshotted ──► staged ──► uploaded ──► committed
     │             │           ├──────► superseded   (another rank's part was superseded)
     │             ├───────────┼──────► superseded   (storage out: gave way to a newer save)
     │             └───────────┴──────► failed
     ├──────────────────────────────► superseded   (a newer save replaced it while waiting)
     └──────────────────────────────► failed
```

* snapshotted: the rank's state is copied into a snapshot arena (``save()`` returned).
* staged: DCP files written to the node-local staging dir; the arena is free again.
* uploaded: the rank's files are durable in storage and its marker is written.
* committed: ``COMMITTED`` names this save (every rank agrees).
* superseded: dropped for a newer save before it could commit (waiting, or its upload
  retrying through a storage outage); never reported as a failure.
* failed: an error stopped it; the previous committed checkpoint stays the recovery point.

The uploader advances a rank's record up to uploaded/committed/superseded/failed; the
worker advances its own record from what every rank reports, so all ranks end in the
same terminal state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ray_goodput.errors import CheckpointError


class SaveState(str, enum.Enum):
    SNAPSHOTTED = "snapshotted"
    STAGED = "staged"
    UPLOADED = "uploaded"
    COMMITTED = "committed"
    SUPERSEDED = "superseded"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (SaveState.COMMITTED, SaveState.SUPERSEDED, SaveState.FAILED)


_ALLOWED: dict[SaveState, frozenset[SaveState]] = {
    SaveState.SNAPSHOTTED: frozenset({SaveState.STAGED, SaveState.SUPERSEDED, SaveState.FAILED}),
    SaveState.STAGED: frozenset({SaveState.UPLOADED, SaveState.SUPERSEDED, SaveState.FAILED}),
    SaveState.UPLOADED: frozenset({SaveState.COMMITTED, SaveState.SUPERSEDED, SaveState.FAILED}),
    SaveState.COMMITTED: frozenset(),
    SaveState.SUPERSEDED: frozenset(),
    SaveState.FAILED: frozenset(),
}


class IllegalTransitionError(CheckpointError):
    """A save was moved along an edge the state machine does not have (a library bug)."""


@dataclass
class SaveRecord:
    """One save of one step as one process sees it. ``error`` is set when failed."""

    step: int
    save_id: str
    state: SaveState = SaveState.SNAPSHOTTED
    error: str | None = None
    history: list[SaveState] = field(default_factory=lambda: [SaveState.SNAPSHOTTED])

    def advance(self, to: SaveState, error: str | None = None) -> None:
        """Move to ``to``; IllegalTransitionError when the machine has no such edge.
        ``error`` is required for, and only for, ``failed``."""
        if to not in _ALLOWED[self.state]:
            raise IllegalTransitionError(
                f"save of step {self.step} ({self.save_id}) cannot go {self.state.value} -> {to.value}"
            )
        if (to is SaveState.FAILED) != (error is not None):
            raise IllegalTransitionError(f"a save goes to failed with an error, and only then (step {self.step})")
        self.state, self.error = to, error
        self.history.append(to)

    def reach(self, to: SaveState, error: str | None = None) -> None:
        """Advance along snapshotted -> staged -> uploaded as far as needed for an edge
        to ``to`` (what a rank's reported state implies), then take it."""
        path = (SaveState.SNAPSHOTTED, SaveState.STAGED, SaveState.UPLOADED)
        while to not in _ALLOWED[self.state] and self.state in path[:-1]:
            self.advance(path[path.index(self.state) + 1])
        self.advance(to, error)


def agree(states: list[SaveState]) -> SaveState | None:
    """The outcome of a save from every rank's state, or None while it is undecided.

    Committed when any rank committed it (the commit needs every rank); else failed when
    any failed; else superseded when any was superseded; else undecided. Every rank
    computes the same answer from the same gathered list. Only a commit is final while a
    rank has not answered: a rank that gave up after writing its marker leaves a step
    another rank can still commit (``Outcomes.resolve`` waits for it).
    """
    if SaveState.COMMITTED in states:
        return SaveState.COMMITTED
    if SaveState.FAILED in states:
        return SaveState.FAILED
    if SaveState.SUPERSEDED in states:
        return SaveState.SUPERSEDED
    return None
