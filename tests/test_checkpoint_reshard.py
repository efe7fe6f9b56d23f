"""Save on N real gloo ranks, restore on M: DDP and FSDP2, bit for bit (DCP resharding).

Cases (mode, saved on, restored on): ddp 2->1, ddp 1->2, fsdp 2->1, fsdp 1->2, fsdp 2->2.
One rank runs in this process; the two-rank saves run in one gloo world and the
two-rank restores in another (spawning a world costs seconds, the restores milliseconds).
"""

from __future__ import annotations

import pytest
import torch

from ray_goodput import Checkpointer
from ray_goodput.testing import run_world
from tests._models import assert_same, full_state, make_model, train_steps, wrap


def _save(rank: int, world: int, root: str, mode: str) -> dict:
    model = wrap(make_model(0), mode if world > 1 else "plain")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, optim, 3, rank)
    with Checkpointer(root, staging_dir=f"{root}-stage-{world}") as ckpt:
        ckpt.save(3, {"model": model, "optim": optim, "note": "hello"})
        ckpt.wait()
    return full_state(model, optim)


def _restore(rank: int, world: int, root: str, mode: str, stage: str) -> tuple:
    model = wrap(make_model(seed=123), mode if world > 1 else "plain")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "note": None}
    with Checkpointer(root, staging_dir=stage) as ckpt:
        step = ckpt.restore(state)
        info = ckpt.last_restore
    return step, state["note"], full_state(model, optim), info.saved_world_size


def _save_both_modes(rank: int, world: int, roots: dict[str, str]) -> dict[str, dict]:
    return {mode: _save(rank, world, root, mode) for mode, root in roots.items()}


def _restore_each(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[tuple]:
    return [_restore(rank, world, root, mode, stage) for mode, root, stage in cases]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{saved_on: (root per mode, full state per mode)}: one rank saves a plain model
    (what both DDP and FSDP restore from), two ranks save a DDP and an FSDP model."""
    base = tmp_path_factory.mktemp("reshard")
    one = str(base / "w1")
    two = {"ddp": str(base / "ddp-w2"), "fsdp": str(base / "fsdp-w2")}
    state_one = _save(0, 1, one, "plain")
    state_two = run_world(_save_both_modes, 2, two)[0]
    return {1: ({"ddp": one, "fsdp": one}, {"ddp": state_one, "fsdp": state_one}), 2: (two, state_two)}


def _check(case: str, result: tuple, saved_state: dict, saved_on: int) -> None:
    step, note, state, saved_world = result
    assert (step, note, saved_world) == (3, "hello", saved_on), case
    assert_same(saved_state, state)


def test_reshard_two_ranks_to_one(saved, tmp_path):
    roots, states = saved[2]
    for mode in ("ddp", "fsdp"):
        result = _restore(0, 1, roots[mode], mode, str(tmp_path / f"{mode}-stage"))
        _check(f"{mode} 2->1", result, states[mode], 2)


def test_reshard_to_two_ranks(saved, tmp_path):
    cases = [("ddp", 1), ("fsdp", 1), ("fsdp", 2)]
    jobs = [(mode, saved[n][0][mode], str(tmp_path / f"{mode}-{n}-stage")) for mode, n in cases]
    per_rank = run_world(_restore_each, 2, jobs)
    for rank, results in enumerate(per_rank):
        for (mode, n), result in zip(cases, results):
            step, note, _, saved_world = result
            assert (step, note, saved_world) == (3, "hello", n), f"{mode} {n}->2 rank {rank}"
    for (mode, n), result in zip(cases, per_rank[0]):  # full state is gathered on rank 0
        _check(f"{mode} {n}->2", result, saved[n][1][mode], n)
