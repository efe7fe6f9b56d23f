"""Properties of the pure position math and epoch orders, over many cases (no I/O)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ray_goodput.data import _partition as part
from ray_goodput.data._order import block_permutation, permutation
from ray_goodput.errors import ConfigError

SIZES = [1, 2, 7, 24, 50, 97, 128]
WORLDS = [1, 2, 3, 4, 5, 8]
BATCHES = [1, 2, 3, 4, 8]


def _step_samples(n: int, consumed: int, world: int, batch: int) -> list[list[list[int]]]:
    """[rank][step] -> permutation positions of that rank's batch."""
    return [[list(range(a, b)) for a, b in part.rank_spans(n, consumed, r, world, batch)] for r in range(world)]


def _run(n: int, consumed: int, world: int, batch: int, steps: int | None = None) -> list[int]:
    per_rank = _step_samples(n, consumed, world, batch)
    counts = {len(x) for x in per_rank}
    assert len(counts) == 1, "every rank must run the same number of steps"
    total = counts.pop()
    steps = total if steps is None else min(steps, total)
    return [p for s in range(steps) for r in range(world) for p in per_rank[r][s]]


def test_one_epoch_is_disjoint_equal_and_drops_less_than_one_global_batch():
    for n, w, b in itertools.product(SIZES, WORLDS, BATCHES):
        for consumed in sorted({0, n // 3, n // 2, n}):
            seen = _run(n, consumed, w, b)
            assert len(seen) == len(set(seen))
            end = part.epoch_end(n, consumed, w, b)
            assert seen == list(range(consumed, end))  # contiguous prefix, in step order
            assert 0 <= n - end < w * b
            for rank_batches in _step_samples(n, consumed, w, b):
                assert all(len(x) == b for x in rank_batches)


def test_resume_at_any_world_size_covers_the_epoch_once():
    cases = 0
    for n, b in itertools.product(SIZES, BATCHES):
        for w1, w2 in itertools.product(WORLDS, WORLDS):
            total1 = part.steps_left(n, 0, w1, b)
            for k in sorted({0, 1, total1 // 2, total1}):
                if k > total1:
                    continue
                before = _run(n, 0, w1, b, steps=k)
                consumed = part.consumed_after(0, k, w1, b)
                assert consumed == len(before)
                after = _run(n, consumed, w2, b)
                union = before + after
                assert len(union) == len(set(union)), (n, b, w1, w2, k)
                assert sorted(union) == list(range(part.epoch_end(n, consumed, w2, b)))
                assert n - len(union) < w2 * b
                cases += 1
    assert cases > 1000


def test_two_restarts_with_batch_size_change():
    for n, (w1, w2, w3), (b1, b2) in itertools.product(
        [50, 97, 128], itertools.product([1, 2, 3], repeat=3), [(2, 2), (4, 3), (1, 8)]
    ):
        c1 = part.consumed_after(0, 3, w1, b1) if part.steps_left(n, 0, w1, b1) >= 3 else 0
        seen = _run(n, 0, w1, b1, steps=c1 // (w1 * b1))
        k2 = part.steps_left(n, c1, w2, b2) // 2
        seen += _run(n, c1, w2, b2, steps=k2)
        c2 = part.consumed_after(c1, k2, w2, b2)
        seen += _run(n, c2, w3, b1)
        assert len(seen) == len(set(seen)) and sorted(seen) == list(range(len(seen)))


def test_loader_workers_take_disjoint_round_robin_stripes():
    for batches, workers in itertools.product(range(0, 20), range(0, 6)):
        owned = [[i for i in range(batches) if part.worker_of_batch(i, workers) == w] for w in range(max(workers, 1))]
        flat = sorted(i for o in owned for i in o)
        assert flat == list(range(batches))


def test_permutations_are_seeded_and_differ_by_epoch():
    for n in (1, 10, 1000):
        p = permutation(n, seed=3, epoch=0, shuffle=True)
        assert sorted(p.tolist()) == list(range(n))
        assert np.array_equal(p, permutation(n, seed=3, epoch=0, shuffle=True))
    assert not np.array_equal(permutation(1000, 3, 0, True), permutation(1000, 3, 1, True))
    assert not np.array_equal(permutation(1000, 3, 0, True), permutation(1000, 4, 0, True))
    assert permutation(5, 3, 0, False).tolist() == [0, 1, 2, 3, 4]


def test_seeds_that_differ_only_above_32_bits_or_in_sign_give_different_orders():
    # The seed was cut to its low 32 bits: seed 1 and seed 2**32 + 1 (or -1 and
    # 2**32 - 1, e.g. seeds from hash()) shuffled every epoch the same way.
    for a, b in ((1, 2**32 + 1), (-1, 2**32 - 1), (7, -7), (2**40, 2**41)):
        assert not np.array_equal(permutation(1000, a, 0, True), permutation(1000, b, 0, True)), (a, b)
        assert not np.array_equal(block_permutation([10] * 100, a, 0, True), block_permutation([10] * 100, b, 0, True))
    # seeds that fitted in 32 bits keep the orders they had (a resumed job reads on where it was)
    assert np.array_equal(permutation(1000, 5, 3, True), np.random.default_rng([5, 3]).permutation(1000))


def test_block_permutation_keeps_blocks_together():
    sizes = [5, 1, 7, 3, 0, 9]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for epoch in range(5):
        p = block_permutation(sizes, seed=1, epoch=epoch, shuffle=True)
        assert sorted(p.tolist()) == list(range(sum(sizes)))
        blocks = np.searchsorted(starts, p, side="right") - 1
        changes = int(np.count_nonzero(np.diff(blocks))) + 1
        assert changes == sum(1 for s in sizes if s)  # each block is one contiguous run


@pytest.mark.parametrize("rank,world,batch", [(0, 0, 1), (2, 2, 1), (-1, 2, 1), (0, 1, 0)])
def test_invalid_world_names_the_setting(rank, world, batch):
    with pytest.raises(ConfigError, match="rank|world_size|batch_size"):
        part.check_world(rank, world, batch)


def test_resume_position_outside_epoch_is_rejected():
    with pytest.raises(ConfigError, match="another dataset"):
        part.check_resume(10, 11)
    with pytest.raises(ConfigError):
        part.steps_left(10, -1, 1, 1)
