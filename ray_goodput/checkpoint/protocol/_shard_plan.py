"""Which rank writes which leaf of the flattened state dict.

DCP's collective planner de-duplicates replicated leaves (DDP parameters, optimizer
``step`` counters, non-tensor values) so each is written once. We plan the same thing
without collectives in the background: every rank describes its leaves, the
descriptions are exchanged once (and again only when the structure changes), and the
owner of each replicated leaf is a deterministic function of all descriptions.

The functions are pure, over plain data. :class:`OwnerPlan` keeps one rank's plan across
saves and gives each save the rank's share (its leaves, local tensors and pickled
values); the exchange itself is the caller's (a gather it passes in).
"""

from __future__ import annotations

import hashlib
import heapq
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ray_goodput.errors import CheckpointError

# Leaf kinds
SHARD = "shard"  # a chunk of a DTensor: every rank writes its own chunk
REPLICATED = "tensor"  # a full tensor present on several ranks: one owner writes it
OBJECT = "object"  # a non-tensor value: one owner writes it


@dataclass(frozen=True)
class Leaf:
    """What a rank holds under one FQN. Offsets/sizes in elements, per dimension."""

    kind: str
    nbytes: int
    global_size: tuple[int, ...] = ()
    global_offset: tuple[int, ...] = ()


def describe(value: Any) -> Leaf:
    """The :class:`Leaf` of one flattened state-dict value."""
    if isinstance(value, DTensor):
        local = value.to_local()
        nbytes = local.numel() * local.element_size()
        if all(isinstance(p, Replicate) for p in value.placements):
            return Leaf(REPLICATED, nbytes, tuple(value.shape), (0,) * value.dim())
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return Leaf(SHARD, nbytes, tuple(value.shape), tuple(offset))
    if isinstance(value, torch.Tensor):
        return Leaf(REPLICATED, value.numel() * value.element_size(), tuple(value.shape), (0,) * value.dim())
    return Leaf(OBJECT, 0)


def signature(leaves: dict[str, Leaf]) -> int:
    """A 63-bit digest of a rank's leaf structure; equal digests mean an equal plan."""
    digest = hashlib.blake2b(pickle.dumps(sorted(leaves.items())), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def assign_owners(leaves_by_rank: list[dict[str, Leaf]]) -> dict[str, int]:
    """Owner rank of every replicated tensor and object.

    Tensors are spread greedily by bytes (largest first, ties by name), each to the
    least-loaded rank among those that hold it; objects go to the lowest rank holding
    them. Shards are absent: each rank writes its own.
    """
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, leaves in enumerate(leaves_by_rank):
        for fqn, leaf in leaves.items():
            if leaf.kind != SHARD:
                holders.setdefault(fqn, []).append(rank)
                sizes[fqn] = leaf.nbytes
    load = [0] * len(leaves_by_rank)
    owners: dict[str, int] = {}
    for fqn in sorted(holders, key=lambda f: (-sizes[f], f)):
        ranks = holders[fqn]
        owner = ranks[0] if sizes[fqn] == 0 else min(ranks, key=lambda r: (load[r], r))
        owners[fqn] = owner
        load[owner] += sizes[fqn]
    return owners


def share_when_all_hold(leaves: dict[str, Leaf], world_size: int, rank: int) -> list[str]:
    """:func:`local_keys` of ``rank`` under :func:`assign_owners` when every one of the
    ``world_size`` ranks holds the same replicated leaves as this one (DDP; or no
    replicated leaf at all), from this rank's leaves alone: the same greedy spread,
    O(leaves x log world) instead of O(leaves x world)."""
    load = [(0, r) for r in range(world_size)]  # a heap: the least-loaded rank, ties by rank
    mine = [fqn for fqn, leaf in leaves.items() if leaf.kind == SHARD]
    for fqn in sorted((f for f, leaf in leaves.items() if leaf.kind != SHARD), key=lambda f: (-leaves[f].nbytes, f)):
        nbytes = leaves[fqn].nbytes
        if nbytes == 0:
            owner = 0
        else:
            done, owner = heapq.heappop(load)
            heapq.heappush(load, (done + nbytes, owner))
        if owner == rank:
            mine.append(fqn)
    return mine


def local_keys(leaves: dict[str, Leaf], owners: dict[str, int], rank: int) -> list[str]:
    """FQNs that ``rank`` writes: its shards and the replicated leaves it owns."""
    return [f for f, leaf in leaves.items() if leaf.kind == SHARD or owners.get(f) == rank]


@dataclass(frozen=True)
class _Failed:
    """What a rank whose capture failed sends to the plan's exchange."""

    error: str


@dataclass(frozen=True)
class Share:
    """What one rank writes of one save."""

    leaves: dict[str, Leaf]  # FQN -> its description, for the leaves this rank writes
    tensors: dict[str, torch.Tensor]  # their tensors (a DTensor's local shard), live
    objects: dict[str, bytes]  # their non-tensor values, pickled
    nbytes: int  # bytes of ``tensors``


class OwnerPlan:
    """One rank's owner plan, reused while the rank's leaf structure is unchanged.

    ``gather(leaves)`` returns every rank's leaves (a collective): it runs at the first
    save and again only when the structure changes, on every rank at the same save (DCP's
    own rule that ranks save alike). A rank re-planning alone enters this collective on the
    default process group while the others go on training: it meets their next collective,
    a checkpoint one (every rank then raises) or a training one, such as DDP's gradient
    all-reduce (an error with gloo, a hang or wrong data with NCCL)."""

    def __init__(self, rank: int, gather: Callable[[Any], list[Any]]) -> None:
        self._rank = rank
        self._gather = gather
        self._cached: tuple[int, dict[str, int]] | None = None  # (structure signature, owners)

    @property
    def exchanges_next(self) -> bool:
        """Whether the next save exchanges the plan on every rank (no plan yet: the first
        save, or the one after a failed exchange), whatever its state."""
        return self._cached is None

    def fail_exchange(self, error: BaseException) -> None:
        """This rank could not capture its state at a save where every rank exchanges its
        plan: it enters the exchange with its error, so that the other ranks raise it too
        instead of waiting in the exchange for this rank's next collective."""
        self._gather(_Failed(f"{type(error).__name__}: {error}"))

    def share(self, flat: dict[str, Any]) -> Share:
        """This rank's share of the flat state dict ``flat`` (values are not copied)."""
        leaves = {fqn: describe(value) for fqn, value in flat.items()}
        sig = signature(leaves)
        if self._cached is None or self._cached[0] != sig:
            gathered = self._gather(leaves)
            failed = [(rank, g) for rank, g in enumerate(gathered) if isinstance(g, _Failed)]
            if failed:
                rank, g = failed[0]
                raise CheckpointError(f"rank {rank} could not capture its state for this save: {g.error}")
            self._cached = (sig, assign_owners(gathered))
        mine = {fqn: leaves[fqn] for fqn in local_keys(leaves, self._cached[1], self._rank)}
        tensors: dict[str, torch.Tensor] = {}
        objects: dict[str, bytes] = {}
        for fqn, leaf in mine.items():
            value = flat[fqn]
            if leaf.kind == OBJECT:
                objects[fqn] = pickle.dumps(value)
            else:
                tensors[fqn] = value.to_local() if isinstance(value, DTensor) else value
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return Share(leaves=mine, tensors=tensors, objects=objects, nbytes=nbytes)
