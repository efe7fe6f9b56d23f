"""Snapshot arenas (``checkpoint/save/_arena.py``, ``_arena_files.py``, ``_arena_pair.py``) and the first save's
arena (``_first_save.py``): tensors handed to DCP own their bytes, the first arena is each
rank's share under the owner plan, sized and touched right after the optimizer's first
step (never by a made-up step), and a Checkpointer that only restores leaves another's
arenas alone. The first save made ready by restore() on the node uploader is in
test_uploader.py."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from ray_goodput import Checkpointer
from ray_goodput.testing import run_world
from tests._helpers import stepped as _stepped


def test_arena_tensors_handed_to_dcp_own_their_bytes_so_dcp_does_not_clone_them(tmp_path):
    """DCP's writer clones a tensor whose storage is larger than the tensor. Views into one
    storage of the whole arena were all cloned: a second copy of the shard into fresh
    memory before the write (fresh pages: 1.3 GB/s on the H200 run)."""
    from ray_goodput.checkpoint.save._arena import Arena, open_slots

    tensors = {"a": torch.randn(100, 30), "b": torch.arange(5, dtype=torch.int16), "e": torch.empty(0)}
    arena = Arena(tmp_path / "rank-00000-1-0.arena")
    try:
        got = open_slots(arena.path, arena.snapshot(tensors))
        for name, t in tensors.items():
            assert torch.equal(got[name], t), name
            assert got[name].untyped_storage().nbytes() == t.nbytes, name
        # Still the arena's memory, not a copy: a newer snapshot shows through.
        tensors["a"].add_(1)
        arena.snapshot(tensors)
        assert torch.equal(got["a"], tensors["a"])
    finally:
        arena.close()


class _Tiny(torch.nn.Module):
    """One large and 250 tiny replicated tensors: the owner plan balances unpadded bytes,
    so one rank gets the tiny ones, which take 64 bytes each in an arena."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(250))
        self.small = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(1)) for _ in range(250))


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_first_saves_arena_size_is_each_ranks_share_under_the_owner_plan(world):
    # Sized from one rank's state alone (no collective in restore): exactly what the
    # owner plan gives the rank when every rank holds the same replicated leaves.
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ray_goodput.checkpoint.protocol import _shard_plan
    from ray_goodput.checkpoint.save import _state_dict
    from ray_goodput.checkpoint.save._arena import aligned
    from ray_goodput.checkpoint.save._first_save import snapshot_size

    models = [
        torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7), torch.nn.Embedding(1000, 33)),
        _Tiny(),
    ]
    for state in map(_stepped, models):
        with _state_dict.saving(_state_dict.classify(state)) as (sd, _):
            flat, _ = flatten_state_dict(sd)
            leaves = {fqn: _shard_plan.describe(v) for fqn, v in flat.items()}
            sizes = {
                fqn: aligned(v.numel() * v.element_size()) for fqn, v in flat.items() if isinstance(v, torch.Tensor)
            }
        owners = _shard_plan.assign_owners([leaves] * world)
        for rank in range(world):
            share = sum(sizes.get(fqn, 0) for fqn in _shard_plan.local_keys(leaves, owners, rank))
            assert snapshot_size(state, world, rank) == share


def test_restore_does_not_step_an_optimizer_that_never_stepped_to_size_the_first_save(tmp_path):
    # Sizing it would run a made-up step (hooks, memory, a GradScaler): a fresh start's
    # first save sizes and touches its arena itself (found in review).
    model = torch.nn.Linear(32, 32)
    optim = torch.optim.AdamW(model.parameters())
    steps: list[int] = []
    optim.register_step_post_hook(lambda *_: steps.append(1))
    with Checkpointer(str(tmp_path / "r"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": model, "optim": optim}) is None
        assert steps == [] and not optim.state and ckpt._arenas.arenas == []


def test_a_fresh_starts_first_save_is_sized_and_touched_right_after_the_optimizers_first_step(tmp_path):
    # restore() cannot size it (the optimizers hold no state yet): a fresh start's first
    # save paid the first touch of every page of its arena (most runs' first save).
    model = torch.nn.Linear(256, 256)
    optim = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optim}
    with Checkpointer(str(tmp_path / "r"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        assert ckpt.restore(state) is None and ckpt._arenas.arenas == []
        model(torch.randn(4, 256)).sum().backward()
        optim.step()
        ckpt._arenas.wait_prepared()  # the background touch is done
        arena = ckpt._arenas.arenas[0]
        assert arena.path.is_relative_to("/dev/shm") and arena.size > 0 and not arena.pinned  # a CPU model
        assert os.stat(arena.path).st_blocks * 512 >= arena.size  # every page is there
        size = arena.size
        optim.step()  # the hook fired once: nothing is sized again
        assert ckpt._arenas.arenas[0] is arena
        ckpt.save(1, state)
        assert ckpt._arenas._first_steps == []  # removed by the save, outside any step()
        assert ckpt._arenas.arenas[0].size == size  # sized ahead: the save did not grow it
        ckpt.wait()
        assert ckpt.stats.committed == [1]


def test_the_second_arena_is_touched_after_the_first_save_not_by_the_save_that_needs_it(tmp_path):
    # Saves that wait for their uploads use one arena; the first burst of saves faster than
    # uploads took the other and paid the first touch of every page of it on the training
    # thread (0.7-1.3 s at 256 MiB a rank, against a 0.05 s copy).
    model = torch.nn.Linear(256, 256)
    with Checkpointer(str(tmp_path / "r"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
        ckpt._arenas.wait_prepared()  # the background touch is done
        first, second = ckpt._arenas.arenas
        assert second.size >= first.size > 0
        assert os.stat(second.path).st_blocks * 512 >= second.size  # every page is there
        size = second.size
        ckpt.wait()
        for step in (2, 3):  # the second arena takes one of them (the first is still held)
            ckpt.save(step, {"model": model})
        assert ckpt._arenas.arenas[1].size == size  # touched ahead: no save grew it
        ckpt.wait()
        assert ckpt.stats.committed[-1] == 3


def test_a_save_before_the_first_step_is_not_taken_for_it(tmp_path, monkeypatch):
    # The save describes the unstepped optimizer by a made-up step, which runs its post-step
    # hooks: the hook that sizes the first arena must be gone by then.
    from ray_goodput.checkpoint.save._arena_pair import ArenaPair

    sized: list[int] = []  # arenas there were at each try to size arena 0
    real = ArenaPair._size_first
    monkeypatch.setattr(
        ArenaPair, "_size_first", lambda self, state: sized.append(len(self.arenas)) or real(self, state)
    )
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optim}
    with Checkpointer(str(tmp_path / "r"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.restore(state)
        assert sized == [0] and ckpt._arenas._first_steps  # tried in restore; now waiting for a step
        ckpt.save(1, state)
        assert sized == [0] and ckpt._arenas._first_steps == [] and not optim.state
        ckpt.wait()  # else save 2 may supersede it in the lane, before its upload started
        model(torch.randn(4, 64)).sum().backward()
        optim.step()
        assert sized == [0]
        ckpt.save(2, state)
        ckpt.wait()
        assert ckpt.stats.committed == [1, 2]


def _fresh_ddp_start(rank: int, world_size: int, root: str, staging: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    )
    optim = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optim}
    with Checkpointer(root, staging_dir=f"{staging}/{rank}", uploader="thread") as ckpt:
        assert ckpt.restore(state) is None
        model(torch.randn(8, 256)).sum().backward()  # DDP's all-reduce: both ranks step together
        optim.step()
        ckpt._arenas.wait_prepared()  # the background touch is done
        arena = ckpt._arenas.arenas[0]
        size = arena.size
        ckpt.save(1, state)
        ckpt.wait()
        from ray_goodput.checkpoint.save._first_save import snapshot_size

        return {
            "size": size,
            "same_arena": ckpt._arenas.arenas[0] is arena and arena.size == size,
            "whole": snapshot_size(state, 1, 0),
            "committed": list(ckpt.stats.committed),
        }


def test_a_fresh_ddp_start_sizes_each_ranks_first_arena_after_the_first_step(tmp_path):
    # Each rank sizes its share alone, inside its step (no collective there): the owner
    # plan that the first save exchanges gives each rank what its hook sized.
    out = run_world(_fresh_ddp_start, 2, str(tmp_path / "root"), str(tmp_path / "s"), timeout_s=240)
    assert all(r["size"] > 0 and r["same_arena"] and r["committed"] == [1] for r in out), out
    assert out[0]["size"] + out[1]["size"] == out[0]["whole"], out  # each its share, not the whole


def test_the_first_step_hook_leaves_the_users_own_post_step_hooks_running(tmp_path):
    # It removed itself while step() was iterating over the hooks: a hook registered after
    # it (an EMA update, a second Checkpointer's) met "OrderedDict mutated during
    # iteration", and the first training step raised (found in review).
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optim}
    with Checkpointer(str(tmp_path / "r"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.restore(state)
        ran: list[int] = []
        optim.register_step_post_hook(lambda *_: ran.append(1))
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward()
            optim.step()
        assert ran == [1, 1] and ckpt._arenas.arenas  # sized after the first step
        ckpt.save(1, state)
        ckpt.wait()
        assert ckpt.stats.committed == [1]


def test_a_fresh_start_whose_optimizer_keeps_no_state_sizes_its_first_arena_after_the_first_step(tmp_path):
    # The first-step hook waited for every optimizer to hold state; SGD without momentum
    # never does, so its first save made the arena itself, on the training thread.
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    with Checkpointer(str(tmp_path / "r"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        assert ckpt.restore(state) is None and not ckpt._arenas.arenas
        model(torch.randn(4, 64)).sum().backward()
        optim.step()
        assert ckpt._arenas.arenas  # sized after the first step
        arena = ckpt._arenas.arenas[0]
        ckpt.save(1, state)
        ckpt.wait()
        assert ckpt.stats.committed == [1] and ckpt._arenas.arenas[0] is arena


def test_a_checkpointer_that_only_restores_leaves_another_ones_arenas_alone(tmp_path):
    # Arenas were named by run, rank and process: a second Checkpointer of the process on
    # the same run (restoring into an eval copy) prepared, resized and unlinked the
    # trainer's arena files (found in review).
    root = str(tmp_path / "r")
    trainer_state = _stepped(torch.nn.Linear(64, 64))
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as trainer:
        trainer.save(1, trainer_state)
        trainer.wait()
        paths = [a.path for a in trainer._arenas.arenas if a.path.exists()]  # arena 1: never used
        assert paths
        with Checkpointer(root, staging_dir=str(tmp_path / "e"), uploader="thread") as evaluator:
            assert evaluator.restore(_stepped(torch.nn.Linear(64, 64))) == 1
            assert not {a.path for a in evaluator._arenas.arenas} & set(paths)
        assert all(p.exists() for p in paths)
        trainer.save(2, trainer_state)
        trainer.wait()
        assert trainer.stats.committed == [1, 2]


def test_a_dead_workers_claim_files_are_swept_only_once_no_uploader_can_still_look(tmp_path, monkeypatch):
    # An uploader whose lane still holds a job the dead worker superseded must find its
    # claim, or it would read an arena that holds a newer snapshot: young claims stay.
    import time

    from ray_goodput.checkpoint.save import _arena_files
    from ray_goodput.checkpoint.save._arena_files import claim, claim_path, sweep_dead
    from tests._helpers import dead_pid

    # A day: claims of this test's age (a live process's claim cannot predate it).
    monkeypatch.setattr(_arena_files, "_CLAIM_SWEEP_AGE_S", 5.0)

    dead = tmp_path / f"rank-00000-{dead_pid()}-0-0.arena"
    alive = tmp_path / f"rank-00000-{os.getpid()}-0-0.arena"
    old, young, mine = claim_path(dead, "old"), claim_path(dead, "young"), claim_path(alive, "old")
    for arena, key in ((dead, "old"), (dead, "young"), (alive, "old")):
        assert claim(arena, key)
    past = time.time() - 10  # past the age; within pid_alive's slack of this live process's start
    os.utime(old, (past, past))
    os.utime(mine, (past, past))
    sweep_dead(tmp_path)
    assert not old.exists() and young.exists() and mine.exists()


def test_a_dead_workers_arenas_of_an_earlier_run_are_swept_from_shared_memory_once_old(tmp_path, monkeypatch):
    # A run whose workers were killed (a crash; the job resubmitted elsewhere) left its
    # arenas in /dev/shm: memory until the node reboots, twice the ranks' state. Before,
    # only a later worker of the same run swept them. Now any run's new arenas on the node
    # sweep other runs' dead arenas and claims once old (a young one may still be read by
    # the node's uploader) and the run directories left empty; a live process's stay.
    import time

    from ray_goodput.checkpoint.save import _arena_files
    from tests._helpers import dead_pid

    monkeypatch.setattr(_arena_files, "OTHER_RUN_SWEEP_AGE_S", 5.0)  # an hour: files of this test's age

    root = tmp_path / "ray_goodput"
    mine, ended, recent, running, empty_old, empty_young = (
        root / name for name in ("mine", "ended", "recent", "running", "empty-old", "empty-young")
    )
    for d in (mine, ended, recent, running, empty_old, empty_young):
        d.mkdir(parents=True)
    dead = dead_pid()
    gone = [ended / f"rank-00000-{dead}-{i}-0.arena" for i in (0, 1)] + [
        ended / f"rank-00000-{dead}-0-0.arena.0123456789abcdef.claim"
    ]
    young = recent / f"rank-00001-{dead}-0-0.arena"
    in_use = running / f"rank-00000-{os.getpid()}-0-0.arena"
    for path in (*gone, young, in_use):
        path.write_bytes(b"x" * 4096)
    past = time.time() - 10  # past the age; within pid_alive's slack of this live process's start
    for path in (*gone, in_use, empty_old):
        os.utime(path, (past, past))

    _arena_files.sweep_dead(mine, other_runs=True)

    assert not any(p.exists() for p in gone)
    assert not ended.exists() and not empty_old.exists()  # emptied by the sweep, or empty and old
    assert young.exists() and in_use.exists() and empty_young.exists()
    assert mine.exists()


def test_a_dead_workers_arena_is_swept_from_its_run_even_when_its_pid_runs_a_later_process(tmp_path):
    # The same run's sweep removes a dead worker's arena at once. A later process that was
    # given the dead worker's pid kept it: memory held until that process ended.
    import time

    from ray_goodput.checkpoint.save._arena_files import sweep_dead

    reused = tmp_path / f"rank-00000-{os.getpid()}-0-0.arena"  # written long before this process started
    mine = tmp_path / f"rank-00000-{os.getpid()}-1-0.arena"
    for path in (reused, mine):
        path.write_bytes(b"x" * 4096)
    long_ago = time.time() - 24 * 3600
    os.utime(reused, (long_ago, long_ago))

    sweep_dead(tmp_path, other_runs=False)

    assert not reused.exists()
    assert mine.exists()


def test_a_dead_workers_arena_is_kept_while_a_job_of_it_waits_in_a_held_file_then_swept(tmp_path):
    # A save held in a file of the node (its uploader not up yet) maps nothing: a restarted
    # worker's sweep unlinked the dead worker's arena before the uploader took the job
    # (tests/test_uploader_faults.py has the same with real processes). A mark kept it.
    import time

    from ray_goodput.checkpoint.save._arena_files import (
        OTHER_RUN_SWEEP_AGE_S,
        held_path,
        mark_held,
        sweep_dead,
        unmark_held,
    )
    from tests._helpers import dead_pid

    pid = dead_pid()
    waiting, abandoned = (tmp_path / f"rank-00000-{pid}-{i}-0.arena" for i in (0, 1))
    for path in (waiting, abandoned):
        path.write_bytes(b"x" * 4096)
    mark_held(waiting, "job-a")
    mark_held(abandoned, "job-b")
    long_ago = time.time() - OTHER_RUN_SWEEP_AGE_S - 60
    os.utime(held_path(abandoned, "job-b"), (long_ago, long_ago))  # nobody took it for an hour
    orphan_mark = held_path(tmp_path / f"rank-00000-{pid}-2-0.arena", "job-c")
    orphan_mark.touch()  # its arena is gone already

    sweep_dead(tmp_path, other_runs=False)

    assert waiting.exists()
    assert not abandoned.exists() and not held_path(abandoned, "job-b").exists()
    assert not orphan_mark.exists()
    unmark_held(waiting, "job-a")  # an uploader mapped it
    sweep_dead(tmp_path, other_runs=False)
    assert list(tmp_path.iterdir()) == []


def test_a_dead_workers_arena_awaited_by_a_dead_uploaders_socket_is_swept(tmp_path):
    # A job written to an uploader's socket marks its arena until that uploader maps it;
    # when the uploader died with the frame unread, nobody ever will, and the mark kept a
    # killed worker's arena (in /dev/shm: memory) for an hour. A mark names its socket's
    # uploader and keeps the arena only while that process lives; a job in a file, which
    # any uploader takes, names none.
    from ray_goodput.checkpoint.save._arena_files import forget_reader, held_path, mark_held, sweep_dead
    from tests._helpers import dead_pid

    pid = dead_pid()
    to_dead, to_live, in_file = (tmp_path / f"rank-00000-{pid}-{i}-0.arena" for i in (0, 1, 2))
    for path in (to_dead, to_live, in_file):
        path.write_bytes(b"x" * 4096)
    mark_held(to_dead, "job-a", reader=dead_pid())
    mark_held(to_live, "job-b", reader=os.getpid())
    mark_held(in_file, "job-c")

    sweep_dead(tmp_path, other_runs=False)

    assert not to_dead.exists() and not held_path(to_dead, "job-a").exists()
    assert to_live.exists() and in_file.exists()
    # An uploader that exits has no frame left to read: it drops the marks naming it first,
    # else its own sweep (made from the process the mark names) kept the arena an hour.
    forget_reader(tmp_path, os.getpid())
    sweep_dead(tmp_path, other_runs=False)
    assert not to_live.exists() and in_file.exists()


_FULL_SHM = """
import sys
from pathlib import Path
import torch
from ray_goodput.checkpoint.save._arena import Arena, open_slots
from ray_goodput.errors import CheckpointError

small, full, disk, ram = (Path(a) for a in sys.argv[1:5])
state = {"w": torch.ones(2 << 20)}  # 8 MiB: more than a 4 MiB filesystem holds
try:
    Arena(small / "run" / "rank-00000-1-1-0.arena").snapshot(state)
    print("no error")
except CheckpointError as exc:
    print("refused", "staging_dir" in str(exc))
moved = Arena(small / "run" / "rank-00000-1-0-0.arena", fallback=disk / "run")
slots = moved.snapshot(state)
print("moved", moved.path.parent == disk / "run", slots[0].nbytes)
# A move whose fallback is full too: the next (smaller) snapshot must not go into the old,
# unlinked mapping while the job reads a new, empty file (which was read as zeros).
stuck = Arena(small / "run" / "rank-00000-1-2-0.arena", fallback=full / "run")
stuck.snapshot({"w": torch.full((1 << 18,), 7.0)})  # 1 MiB fits in /dev/shm
try:
    stuck.snapshot(state)
    print("no error")
except CheckpointError:
    print("refused-both")
slots = stuck.snapshot({"w": torch.full((1 << 18,), 7.0)})
print("read", open_slots(stuck.path, slots)["w"][:2].tolist() == [7.0, 7.0])
# ramfs cannot allocate ahead (nor can NFS before 4.2, ZFS before 2.2, FUSE): the arena
# stays sparse there, and saves work (glibc's emulation failed on an appending file).
on_ram = Arena(ram / "run" / "rank-00000-1-3-0.arena")
slots = on_ram.snapshot({"w": torch.full((1 << 18,), 3.0)})
print("ramfs", open_slots(on_ram.path, slots)["w"][:1].tolist() == [3.0])
"""


def test_a_snapshot_arena_with_no_room_on_its_filesystem_moves_or_refuses_instead_of_killing_the_worker(tmp_path):
    """Arenas were sparse files: each rank of a node found /dev/shm roomy enough, together
    they were not, and the copy into a hole with no room behind it was a SIGBUS that killed
    the training process. Here a 4 MiB tmpfs (mounted in a user namespace) stands for a
    full /dev/shm: the arena moves to its fallback on disk, or, with none, the save gets
    a CheckpointError naming the fix. A move whose fallback is full too leaves no mapping
    of the old file behind: a later snapshot was copied there while its job read a new,
    empty file, and zeros were committed."""
    import subprocess
    import sys

    from tests._helpers import unshare_or_skip

    small, full, disk, ram = tmp_path / "small", tmp_path / "full", tmp_path / "disk", tmp_path / "ram"
    for d in (small, full, ram):
        d.mkdir()
    script = tmp_path / "full_shm.py"
    script.write_text(_FULL_SHM)
    mount = (
        f"mount -t tmpfs -o size=4m none {small} && mount -t tmpfs -o size=4m none {full} && "
        f"mount -t ramfs none {ram} && exec {sys.executable} {script} {small} {full} {disk} {ram}"
    )
    unshare = unshare_or_skip("this test")
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", mount],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 / 135: SIGBUS
    expected = ["refused", "True", "moved", "True", str(8 << 20), "refused-both", "read", "True", "ramfs", "True"]
    assert done.stdout.split() == expected, done.stdout


def test_a_save_supersedes_the_newer_held_snapshot_even_when_its_save_was_already_settled_failed(tmp_path, monkeypatch):
    """Both arenas held: the older job running (the uploader claimed its snapshot), the
    newer one waiting. The pair took the newer by its step among the saves still pending;
    one already agreed failed and dropped from them had no step, so the pair claimed the
    running job's snapshot, which always fails, and waited for its release (600 s by
    default). The newer is the one handed over last, whatever its save's fate."""
    from concurrent.futures import Future

    from ray_goodput.checkpoint.save import _arena_pair
    from ray_goodput.checkpoint.save._arena_files import claim
    from ray_goodput.checkpoint.save._arena_pair import ArenaPair
    from ray_goodput.checkpoint.save._handoff import Handoff
    from ray_goodput.errors import CheckpointError

    monkeypatch.setattr(_arena_pair, "_ARENA_WAIT_S", 2.0)
    pair = ArenaPair(tmp_path / "staging", "run", 0, 1)
    handoffs = []
    for key in ("job-10", "job-20"):
        index, arena = pair.take(1024, step_of=lambda h: -1)
        arena.snapshot({"w": torch.ones(256)})
        handoffs.append(Handoff(released=Future(), durable=Future(), key=key))
        pair.hold(index, handoffs[-1])
    running = pair.arenas[0]
    assert claim(running.path, "job-10")  # the uploader began the older job
    steps = {id(handoffs[0]): 10}  # the newer save was agreed failed: no longer pending
    try:
        index, _ = pair.take(1024, step_of=lambda h: steps.get(id(h), -1))
    except CheckpointError as exc:
        pytest.fail(f"the save waited for the running job's arena: {exc}")
    assert index == 1
    pair.close()


def test_releasing_the_arenas_keeps_one_a_job_no_uploader_has_mapped_yet_still_needs(tmp_path):
    """Leaving ``with Checkpointer`` on an error unlinks both arenas once the goodbye to the
    uploader went unanswered (bounded): a save that had returned, its job unread in the
    uploader's socket or held in a file, lost its snapshot, though a SIGKILLed worker's
    would have been kept by the sweeps, which honour the job's mark. The marked arena is
    now left for them; the other is unlinked as before."""
    from concurrent.futures import Future

    from ray_goodput.checkpoint.save._arena import open_slots
    from ray_goodput.checkpoint.save._arena_files import mark_held
    from ray_goodput.checkpoint.save._arena_pair import ArenaPair
    from ray_goodput.checkpoint.save._handoff import Handoff

    pair = ArenaPair(tmp_path / "staging", "run", 0, 1)
    slots = []
    for value in (1.0, 2.0):
        index, arena = pair.take(1024, step_of=lambda h: -1)
        slots.append(arena.snapshot({"w": torch.full((256,), value)}))
        pair.hold(index, Handoff(released=Future(), durable=Future(), key=f"job-{index}"))
    waiting, other = (a.path for a in pair.arenas)
    mark_held(waiting, "job-0")  # no uploader mapped its job yet
    try:
        pair.close()
        assert waiting.exists() and not other.exists()
        assert torch.equal(open_slots(waiting, slots[0])["w"], torch.full((256,), 1.0))  # the job can still map it
    finally:
        waiting.unlink(missing_ok=True)


def test_the_uploader_keeps_a_dead_workers_arena_that_a_newer_unmapped_job_still_needs(tmp_path):
    # The worker superseded its waiting job A by claiming A's snapshot, copied save C into
    # the same arena, handed C over (held in a file, or unread in the socket) and was
    # killed. A's turn came, its claim failed, it was released, and the uploader unlinked
    # the dead worker's arena at once, ignoring C's mark: C, a save that had returned,
    # failed to open its snapshot and was lost.
    from types import SimpleNamespace

    from ray_goodput.checkpoint.save._arena_files import mark_held, unmark_held
    from ray_goodput.checkpoint.uploader._actor import CheckpointUploader
    from ray_goodput.checkpoint.uploader._arena_sweep import WorkersArenas
    from tests._helpers import dead_pid

    pid = dead_pid()
    arena = tmp_path / f"rank-00000-{pid}-0-0.arena"
    arena.write_bytes(b"x" * 4096)
    mark_held(arena, "job-c")
    uploader = CheckpointUploader.__new__(CheckpointUploader)  # no actor, no watchdog
    uploader._arenas = WorkersArenas()
    released_a = SimpleNamespace(job=SimpleNamespace(owner_pid=pid, arena_path=str(arena), key="job-a", slots=(1,)))
    uploader._released(released_a)
    assert arena.exists()  # C still needs it
    unmark_held(arena, "job-c")  # an uploader mapped C
    uploader._released(released_a)
    assert not arena.exists()


def test_a_dead_workers_held_job_keeps_its_arena_marked_until_the_job_ends(tmp_path):
    # An uploader took a dead worker's held job, staged it and released its arena, which it
    # unlinked (the worker was dead), then died mid-upload: the next uploader took the job
    # again to run it from its snapshot, and found the arena gone. The mark stays until the
    # job ends, so neither the release nor a sweep takes the arena while the job may run again.
    import threading
    from types import SimpleNamespace

    from ray_goodput.checkpoint.save._arena import TensorSlot
    from ray_goodput.checkpoint.save._arena_files import held_path, mark_held, sweep_dead
    from ray_goodput.checkpoint.uploader import _actor
    from ray_goodput.checkpoint.uploader._arena_sweep import WorkersArenas
    from tests._helpers import dead_pid
    from tests.test_uploader import _job

    pid = dead_pid()
    arena = tmp_path / f"rank-00000-{pid}-0-0.arena"
    arena.write_bytes(b"x" * 4096)
    slot = TensorSlot("w", torch.uint8, (4096,), 0, 4096)
    job = dataclasses.replace(_job(tmp_path, arena, slots=(slot,)), owner_pid=pid)
    mark_held(arena, job.key)  # as the worker held it in a file, then died
    tickets = []
    uploader = _actor.CheckpointUploader.__new__(_actor.CheckpointUploader)  # no actor, no watchdog
    uploader.node_id, uploader._lock, uploader._jobs, uploader._arenas = "n", threading.Lock(), {}, WorkersArenas()
    uploader._lanes = {job.lane: SimpleNamespace(submit=tickets.append)}  # a lane that only keeps it
    uploader._metrics = SimpleNamespace(queued=lambda *a: None)
    uploader._resolve_root = lambda root: job.root
    taken = tmp_path / "job.taken"
    taken.touch()
    uploader._accept(job, b"", None, held=taken)  # the orphan path: a dead worker's held job
    (ticket,) = tickets
    for callback in ticket.release_callbacks:  # staged: the arena is let go
        callback(ticket)
    sweep_dead(tmp_path, other_runs=False)
    assert arena.exists() and held_path(arena, job.key).exists()  # a retake still finds it
    for callback in ticket.callbacks:  # the job ended: its held file goes, and the arena with it
        callback(ticket)
    assert not taken.exists() and not held_path(arena, job.key).exists()
    assert not arena.exists()  # not left in /dev/shm for a sweep that no longer looks
