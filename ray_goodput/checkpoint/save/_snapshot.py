"""A rank's snapshot of its state: the part of a save the training loop waits for.

:meth:`Snapshotter.take` turns the user's ``state`` into DCP's flat state dict, decides
which leaves this rank writes (``protocol._shard_plan``; replicated leaves get one owner
across ranks), copies this rank's tensors into one of its two arenas (``_arena_pair``) and
pickles its non-tensor leaves. The :class:`Snapshot` it returns holds everything the
uploader's shard job needs besides where to write it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from ray_goodput.checkpoint.protocol import _collective, _shard_plan
from ray_goodput.checkpoint.save import _state_dict
from ray_goodput.checkpoint.save._arena import TensorSlot
from ray_goodput.checkpoint.save._arena_pair import ArenaPair
from ray_goodput.checkpoint.save._handoff import Handoff


@dataclass(frozen=True)
class Snapshot:
    """One rank's copy of its state: ``slots`` in the arena at ``arena_path`` (index
    ``index`` of the rank's pair, held until its hand-off releases it) and ``objects``."""

    index: int
    arena_path: str
    slots: tuple[TensorSlot, ...]
    objects: dict[str, bytes]  # non-tensor leaves, pickled
    leaves: dict[str, _shard_plan.Leaf]  # the leaves this rank writes
    mappings: Any  # DCP's flattening map (to rebuild the nesting)
    rng: bytes
    unstepped: tuple[str, ...]  # optimizers saved before their first step
    stepped: tuple[str, ...]  # ... and those saved after it

    @property
    def num_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


class Snapshotter:
    """Takes a rank's snapshots into its :class:`ArenaPair`; remembers the owners of
    replicated leaves while the state's structure stays the same."""

    def __init__(self, arenas: ArenaPair, rank: int) -> None:
        self._arenas = arenas
        self._rank = rank
        self._owner_cache: tuple[int, dict[str, int]] | None = None

    def take(self, roles: _state_dict.Roles, *, step_of: Callable[[Handoff | None], int]) -> Snapshot:
        """Copy this rank's share of ``roles`` (blocking: the copy is the save's stall).
        ``step_of`` tells the pair which waiting save to supersede to free an arena.
        Collective only when the state's structure changed (see :meth:`_owners`)."""
        with _state_dict.saving(roles) as (sd, unstepped):
            flat, mappings = flatten_state_dict(sd)
            leaves = {fqn: _shard_plan.describe(value) for fqn, value in flat.items()}
            keys = _shard_plan.local_keys(leaves, self._owners(leaves), self._rank)
            tensors = {k: _local(flat[k]) for k in keys if leaves[k].kind != _shard_plan.OBJECT}
            objects = {k: pickle.dumps(flat[k]) for k in keys if leaves[k].kind == _shard_plan.OBJECT}
            index, arena = self._arenas.take(
                sum(t.numel() * t.element_size() for t in tensors.values()), step_of=step_of
            )
            slots = arena.snapshot(tensors)
        return Snapshot(
            index=index,
            arena_path=str(arena.path),
            slots=tuple(slots),
            objects=objects,
            leaves={k: leaves[k] for k in keys},
            mappings=mappings,
            rng=_state_dict.rng_state_bytes(),
            unstepped=unstepped,
            stepped=tuple(sorted(set(roles.optimizers) - set(unstepped))),
        )

    def _owners(self, leaves: dict[str, _shard_plan.Leaf]) -> dict[str, int]:
        """Owner of each replicated leaf: reused while this rank's structure is unchanged,
        exchanged across ranks when it changes (on every rank at the same save, like DCP's
        own rule that ranks save alike; a rank re-planning alone meets the others' next
        sync and every rank raises instead of hanging)."""
        sig = _shard_plan.signature(leaves)
        if self._owner_cache is not None and self._owner_cache[0] == sig:
            return self._owner_cache[1]
        owners = _shard_plan.assign_owners(_collective.gather_tagged("owner plan", leaves))
        self._owner_cache = (sig, owners)
        return owners


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
