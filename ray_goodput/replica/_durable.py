"""Replica mode's durable fallback: the checkpoints that outlive every replica.

Replica 0 saves every ``save_every`` committed steps, and the first participant of the
job's last step saves that step, through a :class:`~ray_goodput.checkpoint.Checkpointer`
of a world of one (its collectives are its own; nothing calls ``ray.train.report``, whose
barrier would wait for a replica that is being replaced). They are restored when every
replica failed: by replica 0 at a whole-group start, or by replica 0's replacement inside
a quorum where no peer had progress to heal from. Which replica saves or restores, and
when, is :class:`~ray_goodput.replica.Replica`'s decision; this module does it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from ray_goodput.checkpoint import Checkpointer, newest_valid, wait_for_uploads
from ray_goodput.errors import FencedError
from ray_goodput.runtime import world_of_one
from ray_goodput.runtime._resume import cap_restore_upload_wait

logger = logging.getLogger(__name__)


class Progress(Stateful):
    """The replica's data position and torchft's counters, as one checkpointed value."""

    def __init__(self, get: Callable[[], dict[str, int]], put: Callable[[dict[str, int]], None]) -> None:
        self._get, self._put = get, put

    def state_dict(self) -> dict[str, int]:
        return self._get()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._put(state_dict)


class DurableCopy:
    """One replica's durable checkpoints. ``state`` returns what a checkpoint holds (model,
    optimizer, progress, the user's extra state); ``timeout_s`` is the replica's bound on a
    quorum, within which its storage waits stay. The Checkpointer is opened by
    :meth:`open` (replica 0 at its start) or by the final save of another replica."""

    def __init__(
        self,
        slot: int,
        save_every: int | None,
        storage_path: str | None,
        checkpoint: dict[str, Any],
        state: Callable[[], dict[str, Any]],
        timeout_s: float,
    ) -> None:
        self.slot, self.save_every = slot, save_every
        self._storage_path, self._kwargs = storage_path, dict(checkpoint)
        self._state, self._timeout_s = state, timeout_s
        self.ckpt: Checkpointer | None = None
        self.saved_step = -1  # the last step this replica saved (or restored: durable already)

    def open(self) -> None:
        with world_of_one():
            self.ckpt = Checkpointer(self._storage_path, **self._kwargs)

    def restore(self) -> int | None:
        """The newest committed checkpoint's step, loaded, or None (nothing committed, or
        no Checkpointer open)."""
        if self.ckpt is None:
            return None
        step = self.ckpt.restore(self._state())
        if step is not None:
            logger.info("replica %d resumed from the checkpoint of step %d; the others heal from it", self.slot, step)
        return step

    def restore_in_quorum(self) -> int | None:
        """:meth:`restore` inside a step's quorum: its peers wait for it in the step's
        all-reduce (``timeout_s``), so its wait for a dead attempt's uploads is capped at a
        third of that, for this restore only."""
        if self.ckpt is None:
            return None
        cap_restore_upload_wait(self._timeout_s / 3)
        try:
            step = self.ckpt.restore(self._state())
        finally:
            cap_restore_upload_wait(None)
        if step is not None:
            self.saved_step = step  # durable already: when it is the job's last step, nothing is saved again
        return step

    def save_if_due(self, step: int) -> None:
        """Replica 0's periodic save, every ``save_every`` committed steps."""
        if self.ckpt is not None and self.save_every and step % self.save_every == 0:
            self.ckpt.save(step, self._state())
            self.saved_step = step

    def save_final(self, step: int, *, peers_missed_it: bool) -> None:
        """Save the job's last ``step`` unless this replica saved it already. A replica
        without a Checkpointer (replica 0 was being replaced: its first save, a new
        generation, which outranks replica 0's earlier ones), or one whose last step some
        peers missed, first checks that no other replica saved it (:meth:`_saved_elsewhere`)."""
        if not self.save_every or step == self.saved_step:
            return
        fresh = self.ckpt is None
        if fresh:
            self.open()
        if (fresh or peers_missed_it) and self._saved_elsewhere(step):
            return
        if fresh:
            logger.info("replica %d saves the final step %d: replica 0 was not in it", self.slot, step)
        self.ckpt.save(step, self._state())
        self.saved_step = step

    def _saved_elsewhere(self, step: int) -> bool:
        """Whether the newest checkpoint (by lineage, as a restore ranks them) is of ``step``
        or later. A survivor: replica 0 committed the step and ended while this replica's
        vote on it failed, so it computed it again alone; replica 0's stands. Replica 0
        (with 3 or more replicas): it reached the last quorum after the others had
        committed the step without it, saved it (a newer generation) and ended; theirs
        stands, and replica 0's save, in its older generation, would be fenced. That save
        may still be uploading: waited for (within ``timeout_s``). When storage cannot say,
        this replica saves."""
        try:
            wait_for_uploads(self.ckpt.root, above=step - 1, timeout_s=self._timeout_s)
            newest = newest_valid(self.ckpt.root)
        except Exception as exc:  # noqa: BLE001 - the final save matters more than this look
            logger.warning(
                "replica %d saves the final step %d: storage could not say whether another replica did (%s)",
                self.slot,
                step,
                exc,
            )
            return False
        return newest is not None and newest[1].step >= step

    def close(self, *, job_end: int | None = None) -> None:
        """Wait for the last save to commit. A save fenced by a newer generation is no error
        when the checkpoint of the job's last step (``job_end``) is committed: a survivor
        saved it in that generation while this replica, left out of the last quorums, still
        had a save in flight; the job is finished and durable."""
        if self.ckpt is None:
            return
        try:
            self.ckpt.close()
        except FencedError:
            if job_end is None or not self._committed_at_least(job_end):
                raise
            logger.info(
                "replica %d: a save of an earlier step gave way to the checkpoint of the job's last step %d, "
                "which a peer committed",
                self.slot,
                job_end,
            )

    def _committed_at_least(self, step: int) -> bool:
        try:
            newest = newest_valid(self.ckpt.root)
        except Exception:  # storage cannot say: the fence stands as raised
            logger.warning("replica %d: could not list the checkpoints after a fenced save", self.slot, exc_info=True)
            return False
        return newest is not None and newest[1].step >= step

    def release(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        """Unwinding an error: release the Checkpointer without waiting for its uploads
        (its handed-over saves commit in the node uploader)."""
        if self.ckpt is not None:
            self.ckpt.__exit__(exc_type, exc, tb)
