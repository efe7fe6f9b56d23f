"""Save on N real gloo ranks, restore on M: DDP and FSDP2, bit for bit (DCP resharding)."""

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


def _restore(rank: int, world: int, root: str, mode: str) -> tuple:
    model = wrap(make_model(seed=123), mode if world > 1 else "plain")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "note": None}
    with Checkpointer(root, staging_dir=f"{root}-restage-{world}") as ckpt:
        step = ckpt.restore(state)
        info = ckpt.last_restore
    return step, state["note"], full_state(model, optim), info.saved_world_size


@pytest.mark.parametrize("mode,save_world,restore_world", [
    ("ddp", 2, 1), ("ddp", 1, 2), ("fsdp", 2, 1), ("fsdp", 1, 2), ("fsdp", 2, 2),
])
def test_reshard_round_trip(tmp_path, mode, save_world, restore_world):
    root = str(tmp_path / "ckpt")
    saved = run_world(_save, save_world, root, mode)[0]
    results = run_world(_restore, restore_world, root, mode)
    for step, note, _, saved_world in results:
        assert step == 3 and note == "hello" and saved_world == save_world
    assert_same(saved, results[0][2])
