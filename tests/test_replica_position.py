"""The data position of replica mode: every sample of an epoch read once, whoever is alive."""

from __future__ import annotations

import random

import pytest

from ray_goodput.errors import ConfigError
from ray_goodput.replica import _position as pos


def _run_epoch(num_samples: int, batch_size: int, participants_per_step: list[int], commits: list[bool]):
    """Simulate steps with the given participant counts (commit or not); return the samples
    each committed step read, by participant, and the final position."""
    p = pos.Position()
    read: list[int] = []
    for n, committed in zip(participants_per_step, commits):
        if not pos.epoch_has_step(p, num_samples, n, batch_size):
            break
        step = [i for r in range(n) for i in range(*pos.step_span(p, r, n, batch_size))]
        if committed:
            read += step
            p = pos.after_commit(p, n, batch_size)
    return read, p


def test_a_replica_that_is_down_leaves_no_hole_and_no_repeat():
    # 3 replicas, one down for steps 2-4, back at 5: its share is taken by the others
    read, p = _run_epoch(100, 4, [3, 3, 2, 2, 2, 3, 3, 3], [True] * 8)
    assert read == list(range(len(read))) and len(read) == p.consumed == 3 * 4 * 5 + 2 * 4 * 3


def test_a_step_that_does_not_commit_is_read_again_at_the_same_position():
    read, p = _run_epoch(100, 5, [2, 2, 2, 2], [True, False, True, True])
    assert read == list(range(30)) and p.consumed == 30


def test_random_schedules_read_each_sample_of_the_epoch_at_most_once_and_in_order():
    rng = random.Random(7)
    for _ in range(200):
        n_samples, b = rng.randint(10, 300), rng.randint(1, 8)
        steps = [rng.randint(1, 4) for _ in range(400)]
        read, p = _run_epoch(n_samples, b, steps, [rng.random() > 0.2 for _ in steps])
        assert read == list(range(p.consumed))  # a prefix of the permutation, each once
        assert n_samples - p.consumed < max(steps) * b  # only a tail shorter than a step is left


def test_participant_spans_of_one_step_tile_it():
    p = pos.Position(epoch=3, consumed=40)
    spans = [pos.step_span(p, r, 3, 8) for r in range(3)]
    assert spans == [(40, 48), (48, 56), (56, 64)]
    assert pos.after_commit(p, 3, 8) == pos.Position(3, 64)
    assert pos.next_epoch(p) == pos.Position(4, 0)


def test_a_position_from_another_dataset_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="another dataset"):
        pos.check(pos.Position(0, 500), 100)
    with pytest.raises(ConfigError, match="rank 2 is outside"):
        pos.step_span(pos.Position(), 2, 2, 4)
