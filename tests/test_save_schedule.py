"""Checkpointer(every=...) and maybe_save: fixed and automatic intervals, equal on every rank."""

from __future__ import annotations

import time

import pytest
import torch

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.save._schedule import SaveSchedule
from ray_goodput.errors import ConfigError
from ray_goodput.goodput import compute
from ray_goodput.testing import run_world
from tests._models import make_model


def test_fixed_schedule_counts_from_the_last_save_or_restore():
    s = SaveSchedule(5, world_size=2, mtbf_hours=None)
    assert [step for step in range(1, 13) if s.due(step, 0 if step <= 5 else 5 if step <= 10 else 10)] == [5, 10]
    assert s.due(17, 12) and not s.due(16, 12)  # a run restored at step 12
    assert s.proposal() is None and not s.adopt(7) and s.interval_steps() == 5


@pytest.mark.parametrize(
    "every,mtbf,match",
    [
        (0, None, "every must be"),
        ("often", None, "every must be"),
        (True, None, "every must be"),
        (10, 2.0, "mtbf_hours only applies"),
    ],
)
def test_bad_schedule_arguments_name_the_fix(every, mtbf, match):
    with pytest.raises(ConfigError, match=match):
        SaveSchedule(every, world_size=1, mtbf_hours=mtbf)


def test_saves_sync_at_every_sync_every_th_save_and_at_each_warmup_save_of_auto():
    fixed = SaveSchedule(None, world_size=1, mtbf_hours=None, sync_every=3)
    assert [n for n in range(1, 10) if fixed.after_save(0.01, saves_done=n)] == [3, 6, 9]
    auto = SaveSchedule("auto", world_size=1, mtbf_hours=1.0, sync_every=8)
    assert [n for n in range(1, 18) if auto.after_save(0.01, saves_done=n)] == [1, 2, 3, 8, 16]


def test_maybe_save_without_a_schedule_names_the_setting(tmp_path):
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        with pytest.raises(ConfigError, match="every=N"):
            ckpt.maybe_save(1, {"model": make_model(0)})


def test_auto_schedule_moves_from_warmup_to_the_measured_optimum():
    s = SaveSchedule("auto", world_size=8, mtbf_hours=0.001)  # MTBF 3.6 s
    assert s.interval_steps() == 10 and s.due(10, None) and not s.due(9, None)
    for _ in range(20):
        s.observe_step(0.01)
    assert s.after_save(0.005, saves_done=1)  # the warmup's saves sync
    proposal = s.proposal()  # Daly: ~sqrt(2 * 0.005 * 3.6) = 0.19 s of 0.01 s steps
    assert 15 <= proposal <= 22
    assert s.adopt(proposal) and s.interval_steps() == proposal and not s.adopt(proposal)


def _auto_loop(rank: int, world: int, root: str, stage: str) -> tuple[list[int], int]:
    model = make_model(0)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    saved = []
    with Checkpointer(root, staging_dir=f"{stage}-{rank}", uploader="thread", every="auto", mtbf_hours=0.001) as ckpt:
        for step in range(1, 61):
            time.sleep(0.01 * (1 + rank))  # the ranks measure different step times
            if ckpt.maybe_save(step, state):
                saved.append(step)
        return saved, ckpt._schedule.interval_steps()


def test_auto_interval_saves_the_same_steps_on_every_rank_and_settles_after_warmup(tmp_path):
    (saved0, steps0), (saved1, steps1) = run_world(_auto_loop, 2, str(tmp_path / "root"), str(tmp_path / "s"))
    assert saved0 == saved1 and steps0 == steps1  # rank 0's proposal is in force everywhere
    assert saved0[0] == 10 and steps0 != 10  # warmup, then the measured optimum
    gaps = {b - a for a, b in zip(saved0[2:], saved0[3:])}
    assert gaps <= {steps0}, (saved0, steps0)


def test_the_interval_in_force_reaches_the_ledger():
    events = [
        {"e": "start", "t": 0.0},
        {"e": "ckpt_interval", "steps": 10, "t": 1.0},
        {"e": "step", "step": 1, "n": 1, "t0": 1.0, "t": 2.0},
        {"e": "ckpt_interval", "steps": 17, "t": 3.0},
        {"e": "end", "t": 4.0},
    ]
    ledger = compute([events])
    assert ledger.checkpoint_interval_steps == 17
    assert ledger.as_metrics()["goodput/checkpoint_interval_steps"] == 17
