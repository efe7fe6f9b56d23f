"""Who am I in the training world: Ray Train context, else torch.distributed, else alone."""

from __future__ import annotations

import logging

from ray_goodput.errors import ConfigError

logger = logging.getLogger(__name__)


def detect_world() -> tuple[int, int]:
    """(rank, world_size) of this process."""
    try:
        import ray.train  # noqa: PLC0415 - optional at import time

        ctx = ray.train.get_context()
        return ctx.get_world_rank(), ctx.get_world_size()
    except (RuntimeError, ImportError, AttributeError):
        pass  # not inside a Ray Train worker
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit (rank, world_size) when given (both or neither), else the detected ones.

    Raises ConfigError when only one is given, or when they contradict a detected
    distributed world (every rank must agree on the world to take disjoint stripes)."""
    if (rank is None) != (world_size is None):
        raise ConfigError("pass both rank= and world_size= to the DataLoader, or neither "
                          "(then they come from the Ray Train context or torch.distributed)")
    detected = detect_world()
    if rank is None:
        return detected
    if detected[1] > 1 and (rank, world_size) != detected:
        raise ConfigError(f"DataLoader got rank={rank}, world_size={world_size} but this "
                          f"process is rank {detected[0]} of {detected[1]}; drop the "
                          "explicit values or make them match")
    return rank, world_size
