"""Stand-ins shared by the replica tests that drive one ``Replica`` without torchft or Ray."""

from __future__ import annotations

from ray_goodput.replica._durable import DurableCopy


class AloneInQuorum:
    """Stand-in for torchft's Manager in a quorum of one at step 0 (its peers are gone)."""

    def start_quorum(self, timeout=None) -> None:
        pass

    def num_participants(self) -> int:
        return 1

    def current_step(self) -> int:
        return 0


def durable_copy(rep, *, slot: int, save_every: int | None, root: str | None = None, timeout_s: float = 30.0):
    """The replica's durable fallback as ``Replica.__init__`` makes it (nothing opened)."""
    return DurableCopy(slot, save_every, root, {"uploader": "thread"}, lambda: rep._durable_state(), timeout_s)
