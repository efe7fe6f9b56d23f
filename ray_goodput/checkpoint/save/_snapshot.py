"""A rank's save up to its hand-off: the part the training loop waits for.

:meth:`Snapshotter.hand_off` reads top-down, one step per module, each called once:

1. ``_state_dict.capture``: the user's ``state`` as DCP's flat state dict;
2. ``protocol._shard_plan``: the rank's share of it (replicated leaves get one owner
   across ranks), its non-tensor leaves pickled;
3. ``_arena_pair`` / ``_arena``: an arena no job holds, and the copy of the share's
   tensors into it (the only part that takes time);
4. the backend's ``submit``: the ``ShardJob`` goes to the uploader; the arena stays the
   job's until the hand-off releases it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ray_goodput.checkpoint.protocol import _collective, _shard_plan
from ray_goodput.checkpoint.save import _state_dict
from ray_goodput.checkpoint.save._arena_pair import ArenaPair
from ray_goodput.checkpoint.save._handoff import Handoff, UploadBackend

if TYPE_CHECKING:  # the uploader's type, named here for the annotation only
    from ray_goodput.checkpoint.uploader._shard_job import ShardJob


class Snapshotter:
    """Takes a rank's snapshots into its :class:`ArenaPair` and hands them off."""

    def __init__(self, arenas: ArenaPair, rank: int) -> None:
        self._arenas = arenas
        self._plan = _shard_plan.OwnerPlan(rank, functools.partial(_collective.gather_tagged, "owner plan"))

    def hand_off(
        self,
        state: dict[str, Any],
        *,
        job: Callable[..., ShardJob],
        backend: UploadBackend,
        step_of: Callable[[Handoff | None], int],
    ) -> Handoff:
        """Copy this rank's share of ``state`` into an arena (blocking: the copy is the
        save's stall) and submit ``job(...)`` (the snapshot's fields added) to ``backend``.
        ``step_of`` tells the pair which waiting save to supersede to free an arena.
        Collective only when the state's structure changed (see ``OwnerPlan``)."""
        self._arenas.stop_watching_steps()  # the capture's made-up steps are not the optimizers' first
        try:
            captured = _state_dict.capture(state)
        except Exception as exc:
            if self._plan.exchanges_next:  # the others wait in the plan's exchange: they raise too
                self._plan.fail_exchange(exc)
            raise
        share = self._plan.share(captured.flat)
        index, arena = self._arenas.take(share.nbytes, step_of=step_of)
        slots = arena.snapshot(share.tensors)
        handoff = backend.submit(
            job(
                arena_path=str(arena.path),
                slots=tuple(slots),
                objects=share.objects,
                leaves=share.leaves,
                mappings=captured.mappings,
                rng=captured.rng,
                num_bytes=share.nbytes,
                unstepped=captured.unstepped,
                stepped=captured.stepped,
            )
        )
        self._arenas.hold(index, handoff)
        return handoff
