"""Position math of an epoch: pure functions over plain ints, no I/O, no state.

Vocabulary (all counts are samples unless the name says otherwise):

- ``num_samples``: samples of the dataset, N.
- ``world_size`` W and ``rank`` r: the training processes and this one.
- ``batch_size`` B: samples per rank per step; a *global step* takes ``W * B`` samples.
- ``consumed``: samples of the epoch's permutation taken by finished global steps. At a step
  boundary it is a multiple of the ``W * B`` in force when those steps ran, so it is a
  prefix length of the permutation, whatever world size ran them.

Layout of one epoch, from position ``consumed`` on, for world W::

    permutation:  [ consumed | step 0: r0 r1 .. rW-1 | step 1: r0 .. | ... | tail < W*B ]
                                      ^ B each

The tail (fewer than ``W * B`` samples) is dropped, the same on every rank, so every rank
runs the same number of steps (``ray.train.report`` is a barrier). DataLoader workers need
no math of their own: torch hands batch k of a rank to worker ``k % num_workers``.
"""

from __future__ import annotations

from ray_goodput.errors import ConfigError


def check_world(rank: int, world_size: int, batch_size: int) -> None:
    """Raise ConfigError naming the setting when (rank, world_size, batch_size) is invalid."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"rank {rank} is outside the world of size {world_size}; pass a "
            "rank in [0, world_size) or let the loader read the Ray Train context"
        )
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")


def global_batch(world_size: int, batch_size: int) -> int:
    """Samples taken by one global step: W * B."""
    return world_size * batch_size


def steps_left(num_samples: int, consumed: int, world_size: int, batch_size: int) -> int:
    """Whole global steps left in the epoch from ``consumed`` (the ragged tail is dropped)."""
    if not 0 <= consumed <= num_samples:
        raise ConfigError(f"consumed={consumed} is outside the epoch of {num_samples} samples")
    return (num_samples - consumed) // global_batch(world_size, batch_size)


def epoch_end(num_samples: int, consumed: int, world_size: int, batch_size: int) -> int:
    """Position after the last whole step: samples of the epoch that are used in total."""
    gb = global_batch(world_size, batch_size)
    return consumed + steps_left(num_samples, consumed, world_size, batch_size) * gb


def batch_span(consumed: int, step: int, rank: int, world_size: int, batch_size: int) -> tuple[int, int]:
    """[start, stop) in the permutation of ``rank``'s batch at ``step`` steps after ``consumed``.

    Shape: stop - start == batch_size.
    """
    start = consumed + step * global_batch(world_size, batch_size) + rank * batch_size
    return start, start + batch_size


def rank_spans(num_samples: int, consumed: int, rank: int, world_size: int, batch_size: int) -> list[tuple[int, int]]:
    """Every batch span of ``rank`` for the rest of the epoch; len == steps_left(...)."""
    n = steps_left(num_samples, consumed, world_size, batch_size)
    return [batch_span(consumed, s, rank, world_size, batch_size) for s in range(n)]


def consumed_after(consumed: int, steps: int, world_size: int, batch_size: int) -> int:
    """Position after ``steps`` more global steps: the ``consumed`` to save in a state."""
    return consumed + steps * global_batch(world_size, batch_size)


def check_resume(num_samples: int, consumed: int) -> None:
    """Raise ConfigError when a saved position cannot belong to this epoch."""
    if not 0 <= consumed <= num_samples:
        raise ConfigError(
            f"loader state has consumed={consumed} but the dataset has "
            f"{num_samples} samples; the state belongs to another dataset"
        )


def worker_of_batch(batch_index: int, num_workers: int) -> int:
    """DataLoader worker that produces a rank's batch ``batch_index`` (torch round robin)."""
    return batch_index % num_workers if num_workers > 0 else 0
