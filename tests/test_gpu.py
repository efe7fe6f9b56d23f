"""The CUDA paths of checkpointing: the pinned snapshot arena, per-device CUDA RNG, a
save/restore round trip of a model and optimizer that live on the GPU; and the default
node health check, ``Recovery(health_check="gpu")``, on a real GPU.

They need a CUDA device, which CI's machines do not have: there they are reported as
skipped (``-ra``), and docs/limitations.md says where and when they last ran.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.save._arena import Arena, open_slots
from ray_goodput.checkpoint.save._state_dict import restore_cuda_rng
from ray_goodput.driver import _gpu_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def shm_dir():
    path = Path("/dev/shm") / f"ray_goodput-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _snapshot_and_check(arena: Arena) -> None:
    tensors = {
        "w": torch.randn(1024, 1024, device="cuda"),
        "h": torch.randn(333, device="cuda").to(torch.bfloat16),
        "i": torch.arange(17, device="cuda"),
    }
    slots = arena.snapshot(tensors)
    got = open_slots(arena.path, slots)
    for name, t in tensors.items():
        assert got[name].device.type == "cpu"
        assert torch.equal(got[name], t.cpu()), name
    # A later snapshot into the same arena sees the new values.
    tensors["w"].mul_(2)
    slots = arena.snapshot(tensors)
    assert torch.equal(open_slots(arena.path, slots)["w"], tensors["w"].cpu())


def test_an_arena_in_shared_memory_pins_itself_for_cuda_and_holds_exact_copies(shm_dir):
    arena = Arena(shm_dir / "rank-00000-1-0.arena")
    try:
        _snapshot_and_check(arena)
        assert arena.pinned, "the /dev/shm arena was not registered as pinned host memory"
    finally:
        arena.close()


def test_an_arena_the_kernel_will_not_pin_leaves_no_cuda_error_behind(tmp_path):
    """Linux 6.5 on refuses to page-lock a shared mapping of a file outside tmpfs (the
    staging-dir arena): cudaHostRegister fails, and its error must not surface at the
    user's next kernel launch."""
    arena = Arena(tmp_path / "rank-00000-1-0.arena")
    try:
        _snapshot_and_check(arena)
        torch.rand(4, device="cuda").sum().item()  # raised "invalid argument" before the fix
    finally:
        arena.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_snapshot_of_tensors_on_two_gpus_holds_both_copies_when_it_returns(shm_dir):
    """The copies run on each source's device; the snapshot waited for the current device
    only, so a state split across two GPUs could return before the second one's copies
    ended (the next optimizer step then changed what the checkpoint holds)."""
    arena = Arena(shm_dir / "rank-00000-1-0.arena")
    try:
        with torch.cuda.device(0):
            tensors = {f"w{d}": torch.randn(8192, 8192, device=f"cuda:{d}") for d in (0, 1)}  # 256 MiB each
            expected = {k: t.cpu() for k, t in tensors.items()}
            slots = arena.snapshot(tensors)
            # Asked before anything else syncs cuda:1: its copy, queued on its own stream,
            # is done (the old snapshot waited for cuda:0 only).
            assert torch.cuda.current_stream(torch.device("cuda:1")).query()
            got = open_slots(arena.path, slots)
            assert all(torch.equal(got[k], expected[k]) for k in tensors)
    finally:
        arena.close()


def test_cuda_rng_is_restored_on_every_local_device():
    count = torch.cuda.device_count()
    saved = torch.cuda.get_rng_state_all()
    expected = [torch.rand(4, device=f"cuda:{i}") for i in range(count)]
    for i in range(count):
        torch.rand(100, device=f"cuda:{i}")  # move every device's generator on
    assert restore_cuda_rng(saved) == count
    assert all(torch.equal(torch.rand(4, device=f"cuda:{i}"), expected[i]) for i in range(count))
    # Saved on more devices than this worker sees: the ones it has are restored.
    assert restore_cuda_rng([*saved, saved[0]]) == count
    assert torch.equal(torch.rand(4, device="cuda:0"), expected[0])


def _cuda_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": optim}


def _step(state: dict) -> None:
    x = torch.randn(32, 256, device="cuda")
    state["model"](x).square().mean().backward()
    state["optim"].step()
    state["optim"].zero_grad(set_to_none=True)


def test_a_gpu_model_and_optimizer_round_trip_with_the_cuda_rng(tmp_path):
    root = str(tmp_path / "root")
    state = _cuda_state(0)
    for _ in range(2):
        _step(state)
    torch.cuda.manual_seed(11)
    with Checkpointer(root, staging_dir=str(tmp_path / "s1"), uploader="thread") as ckpt:
        ckpt.save(3, state)
    expected_rand = torch.rand(5, device="cuda")
    _step(state)  # what training after the save does; the restored run must repeat it
    expected = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}

    fresh = _cuda_state(99)
    torch.cuda.manual_seed(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "s2"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 3
    assert all(p.device.type == "cuda" for p in fresh["model"].parameters())
    assert all(
        v.device.type == "cuda"
        for s in fresh["optim"].state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    assert torch.equal(torch.rand(5, device="cuda"), expected_rand)
    _step(fresh)  # draws its batch from the restored generator, as the saved run's step did
    for name, value in fresh["model"].state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_the_first_saves_arena_is_pinned_in_the_background_before_the_first_save(tmp_path):
    # Pinning a rank's arena (GBs) took seconds of the first GPU save; restore() now has
    # it pinned, with its pages touched, before the save (a fresh start: after the first step).
    for stepped_before_restore in (True, False):
        state = _cuda_state(0)
        if stepped_before_restore:
            _step(state)
        with Checkpointer(
            str(tmp_path / f"r{stepped_before_restore}"), staging_dir=str(tmp_path / "s"), uploader="thread"
        ) as ckpt:
            ckpt.restore(state)
            if not stepped_before_restore:
                _step(state)
            ckpt._arenas.wait_prepared()  # the background work is done
            arena = ckpt._arenas.arenas[0]
            assert arena.path.is_relative_to("/dev/shm") and arena.pinned
            size = arena.size
            ckpt.save(1, state)
            # Sized exactly: a grown arena would be unpinned and pinned again in the save.
            assert ckpt._arenas.arenas[0] is arena and arena.pinned and arena.size == size
            ckpt.wait()
            assert ckpt.stats.committed == [1]


def test_the_default_gpu_health_check_passes_on_a_healthy_gpu():
    assert _gpu_check.check_device(torch.device("cuda", 0), alloc_gib=1.0) is None
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the check turns it off while it runs
    try:
        assert _gpu_check.gpu_check(alloc_gib=1.0) is True
        assert torch.backends.cuda.matmul.allow_tf32 is True  # put back for the task's next user
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
