"""Tensors passed as plain values are tensor leaves: ``{"model": model.state_dict(), "optim":
optim.state_dict()}`` (the most common way DCP is used), nested dicts of tensors, DTensors
of an FSDP2 model's state dict, a mixed tree. They used to be pickled whole inside
``save()`` (0.31-0.53 s of a 256 MiB save), skipping the arena, not resharded, and
unpickled whole on restore. Each is saved on 2 real gloo ranks and restored on 1, bit for bit.
"""

from __future__ import annotations

import collections
import logging

import pytest
import torch

from ray_goodput import Checkpointer
from ray_goodput.testing import run_world
from tests._models import full_state, make_model, train_steps, wrap
from tests.test_save_states import FakeBackend

Pair = collections.namedtuple("Pair", "a b")


def _tree(rank: int) -> dict:
    """A mixed tree: tensors in dicts, lists, tuples, a namedtuple, beside non-tensors."""
    g = torch.Generator().manual_seed(7)  # the same on every rank (replicated, as DDP's are)
    return {
        "ema": {"layer": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}},
        "hist": [torch.arange(10, dtype=torch.int64), "label", 3],
        "pair": Pair(torch.ones(3, dtype=torch.float16), (torch.zeros(2, 2), 1.5)),
        "scaler": {"scale": torch.tensor(65536.0), "growth_tracker": 4},
    }


def _save(rank: int, world: int, root: str, mode: str) -> dict:
    model = wrap(make_model(0), mode)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, optim, 3, rank)
    inner = model.module if mode == "ddp" else model  # DDP's own keys carry a "module." prefix
    state = {"model": inner.state_dict(), "optim": optim.state_dict(), "extra": _tree(rank)}
    with Checkpointer(root, staging_dir=f"{root}-stage-{rank}", uploader="thread") as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
    return full_state(model, optim)


def _save_both(rank: int, world: int, roots: dict) -> dict:
    return {mode: _save(rank, world, root, mode) for mode, root in roots.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two ranks save a DDP model's and an FSDP2 model's state dicts (DTensors), with a tree."""
    base = tmp_path_factory.mktemp("plain")
    roots = {mode: str(base / mode) for mode in ("ddp", "fsdp")}
    return roots, run_world(_save_both, 2, roots)[0]


def _same_tree(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_tree(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_state_dicts_and_a_mixed_tree_saved_on_two_ranks_restore_on_one_bit_for_bit(saved, mode, tmp_path):
    roots, states = saved
    model = make_model(seed=123)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    weights = model.state_dict()  # live tensors: loaded in place
    state = {"model": weights, "optim": optim.state_dict(), "extra": {"ema": {}}}
    with Checkpointer(roots[mode], staging_dir=str(tmp_path / "r"), uploader="thread") as ckpt:
        assert ckpt.restore(state) == 3
    assert all(state["model"][k] is weights[k] for k in weights)  # in place, into the model
    optim.load_state_dict(state["optim"])  # the optimizer state the checkpoint had, created here
    assert states[mode] is not None
    got = full_state(model, optim)
    for k, v in states[mode]["model"].items():
        assert torch.equal(got["model"][k], v), k
    for k, s in states[mode]["optim"].items():
        for n, v in s.items():
            assert torch.equal(torch.as_tensor(got["optim"][k][n]), torch.as_tensor(v)), (k, n)
    _same_tree(state["extra"], _tree(0))  # the saved structure, not the placeholder's


def test_plain_tensors_go_through_the_arena_not_pickle(tmp_path):
    backend = FakeBackend()
    big = {f"w{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB
    ckpt = Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "s"), uploader=backend)
    try:
        ckpt.save(1, {"params": big, "note": "x"})
        job = backend.jobs[1]
        assert job.num_bytes >= 4 * 256 * 1024 * 4  # copied into the snapshot arena
        assert sum(len(raw) for raw in job.objects.values()) < 10_000  # only the small skeleton is pickled
    finally:
        ckpt._release()


def test_a_state_whose_plain_tensors_differ_from_the_checkpoint_follows_the_rule_and_names_them(tmp_path, caplog):
    root = str(tmp_path / "root")
    saved = {"w": torch.randn(4, 4), "kept": torch.randn(3), "only_saved": torch.arange(5)}
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"ema": saved})
    live = torch.zeros(3)
    state = {"ema": {"kept": live, "only_here": torch.ones(2), "w": torch.zeros(4, 4)}}
    with caplog.at_level(logging.INFO), Checkpointer(root, staging_dir=str(tmp_path / "r"), uploader="thread") as ckpt:
        assert ckpt.restore(state) == 1
    restored = state["ema"]
    assert set(restored) == {"w", "kept", "only_saved"}  # the saved structure
    assert restored["kept"] is live and torch.equal(live, saved["kept"])  # in place
    assert torch.equal(restored["only_saved"], saved["only_saved"]) and restored["only_saved"].dtype == torch.int64
    assert "not in the checkpoint" in caplog.text and "only_here" in caplog.text
    assert "new here" in caplog.text and "only_saved" in caplog.text
    shape = {"ema": {"w": torch.zeros(2, 2)}}
    with pytest.raises(Exception, match="does not match the state passed to restore"):
        with Checkpointer(root, staging_dir=str(tmp_path / "m"), uploader="thread") as ckpt:
            ckpt.restore(shape)
