"""The seeded order of an epoch: a permutation of sample indices, the same on every rank."""

from __future__ import annotations

import numpy as np

_WORD = 0xFFFFFFFF


def _rng(seed: int, epoch: int) -> np.random.Generator:
    """A SeedSequence of (seed, epoch): epochs independent, platform stable. Any int seed:
    one in [0, 2**32) is the words (seed, epoch), as it always was (a resumed job's order
    does not change); any other adds its high bits and a nonzero sign word (a
    SeedSequence ignores trailing zero words), so no two seeds share an order."""
    seed, epoch = int(seed), int(epoch)
    words = [abs(seed) & _WORD, epoch & _WORD]
    if not 0 <= seed <= _WORD:
        words += [abs(seed) >> 32, 1 if seed < 0 else 2]
    return np.random.default_rng(words)


def permutation(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Sample indices of the epoch in order. Shape: (num_samples,), int64."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return _rng(seed, epoch).permutation(num_samples).astype(np.int64)


def block_permutation(block_sizes: list[int], seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Permutation that keeps samples of a block (a Parquet row group) together.

    Blocks are shuffled, then samples inside each block. Still a permutation of
    ``sum(block_sizes)`` indices, so all position math applies; a reader decodes each
    row group about once per rank instead of once per sample. Shape: (sum(block_sizes),).
    """
    starts = np.concatenate([[0], np.cumsum(block_sizes, dtype=np.int64)])
    if not shuffle:
        return np.arange(int(starts[-1]), dtype=np.int64)
    rng = _rng(seed, epoch)
    parts = []
    for b in rng.permutation(len(block_sizes)):
        parts.append(starts[b] + rng.permutation(int(block_sizes[b])))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64)
