"""Checkpointer save/restore, commit protocol, fallback and retention on real storage
(local directory and a real S3 endpoint over HTTP) and real gloo ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ray_goodput import Checkpointer, list_checkpoints
from ray_goodput.checkpoint.protocol import _catalog, _layout
from ray_goodput.checkpoint.protocol._commit import CommitProtocol, finish_orphan
from ray_goodput.checkpoint.protocol._manifest import read_manifest, read_quarantine
from ray_goodput.checkpoint.save._state_dict import restore_cuda_rng
from ray_goodput.checkpoint.uploader._shard_job import write_local
from ray_goodput.checkpoint.uploader._thread_backend import ThreadBackend
from ray_goodput.errors import CheckpointError, ConfigError, StateMismatchError, StorageUnusableError
from ray_goodput.storage import RetryPolicy, list_dir, resolve
from ray_goodput.testing import free_port, kill_self, run_world, wait_for
from tests._models import assert_same, full_state, make_model, train_steps, wrap


class Counter:
    """A user Stateful."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path, s3_server):
    return str(tmp_path / "root") if request.param == "local" else s3_server.bucket_uri("run")


def _state(seed: int) -> dict:
    model = make_model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": optim, "counter": Counter(), "extras": {"epoch": 0}}


def test_round_trip_bit_for_bit_with_rng_and_extras(root, tmp_path):
    state = _state(0)
    train_steps(state["model"], state["optim"], 2, rank=0)
    state["counter"].n, state["extras"] = 41, {"epoch": 3, "tokens": [1, 2]}
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    with Checkpointer(root, staging_dir=str(tmp_path / "s1")) as ckpt:
        ckpt.save(7, state)
    expected_rng = (random.random(), np.random.rand(), torch.rand(2))
    saved = full_state(state["model"], state["optim"])

    fresh = _state(99)
    random.seed(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "s2")) as ckpt:  # no local copy
        assert ckpt.restore(fresh) == 7
        assert ckpt.last_restore.remote_files > 0 and ckpt.last_restore.local_files == 0
    assert (random.random(), np.random.rand()) == expected_rng[:2]
    assert torch.equal(torch.rand(2), expected_rng[2])
    assert_same(saved, full_state(fresh["model"], fresh["optim"]))
    assert fresh["counter"].n == 41 and fresh["extras"] == {"epoch": 3, "tokens": [1, 2]}
    # Training continues identically from the restored optimizer state.
    train_steps(state["model"], state["optim"], 1, rank=0, start=2)
    train_steps(fresh["model"], fresh["optim"], 1, rank=0, start=2)
    assert_same(full_state(state["model"], state["optim"]), full_state(fresh["model"], fresh["optim"]))


def test_restore_cuda_rng_on_a_machine_without_devices_restores_none():
    # CPU CI: the per-device loop runs and sets nothing (device_count() == 0).
    assert restore_cuda_rng([torch.zeros(16, dtype=torch.uint8)] * 2) == 0


def test_a_save_before_the_first_optimizer_step_changes_neither_training_nor_the_restored_run(tmp_path):
    """Saving an AdamW that had not stepped gave it state (step 1, zero moments): DCP's
    optimizer state dict initializes one to have something to save. The run that saved at
    step 0 then used step 2's bias correction at its first step, and so did a run restored
    from that save: both drifted from a run that never saved."""

    def adamw() -> dict:
        model = make_model(0)
        return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}

    never_saved = adamw()
    train_steps(never_saved["model"], never_saved["optim"], 2, rank=0)
    saved = adamw()
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "a"), uploader="thread") as ckpt:
        ckpt.save(0, saved)
        assert len(saved["optim"].state) == 0
        train_steps(saved["model"], saved["optim"], 2, rank=0)
    assert_same(full_state(never_saved["model"], never_saved["optim"]), full_state(saved["model"], saved["optim"]))
    restored = adamw()
    train_steps(restored["model"], restored["optim"], 1, rank=0)  # stepped, then restored
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        assert ckpt.restore(restored) == 0
    assert len(restored["optim"].state) == 0
    train_steps(restored["model"], restored["optim"], 2, rank=0)
    assert_same(
        full_state(never_saved["model"], never_saved["optim"]), full_state(restored["model"], restored["optim"])
    )


def _save_unstepped_sharded(rank: int, world: int, root: str, stage: str) -> int:
    model = wrap(make_model(0), "fsdp")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(root, staging_dir=f"{stage}{rank}", uploader="thread") as ckpt:
        ckpt.save(0, {"model": model, "optim": optim})
    return len(optim.state)


def test_an_unstepped_sharded_optimizer_stays_unstepped_when_saved_and_resharded_2_to_1(tmp_path):
    root = str(tmp_path / "root")
    assert run_world(_save_unstepped_sharded, 2, root, str(tmp_path / "a")) == [0, 0]
    state = {"model": make_model(5)}
    state["optim"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-2)
    train_steps(state["model"], state["optim"], 1, rank=0)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        assert ckpt.restore(state) == 0
    assert len(state["optim"].state) == 0
    fresh = make_model(0).state_dict()
    assert all(torch.equal(fresh[k], v) for k, v in state["model"].state_dict().items())


def _frozen_unless(rank: int, seed: int) -> dict:
    model = make_model(seed)
    for p in model.parameters():
        p.requires_grad_(rank == 0)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def _one_rank_never_steps(rank: int, world: int, root: str, stage: str) -> tuple[int, int]:
    """Rank 1's parameters are frozen (a pipeline stage that gets no gradients): its
    optimizer never has state, while rank 0's steps. Same keys on both ranks."""
    state = _frozen_unless(rank, rank)
    with Checkpointer(root, staging_dir=f"{stage}{rank}", uploader="thread") as ckpt:
        ckpt.save(0, state)  # both fresh
        if rank == 0:
            train_steps(state["model"], state["optim"], 1, rank)
        ckpt.save(1, state)  # rank 0 stepped, rank 1 still fresh
        ckpt.wait()
    restored = _frozen_unless(rank, rank + 7)
    with Checkpointer(root, staging_dir=f"{stage}{rank}-b", uploader="thread") as ckpt:
        step = ckpt.restore(restored)
    return step, len(restored["optim"].state)


def test_ranks_that_disagree_on_whether_an_optimizer_stepped_keep_the_stepped_state(tmp_path):
    """One rank's "never stepped" was saved as the answer for all: a restore cleared rank
    0's real moments, and the save after rank 0's first step changed only its own saved
    structure, so the ranks re-planned at different saves and the save failed."""
    got = run_world(_one_rank_never_steps, 2, str(tmp_path / "root"), str(tmp_path / "s"))
    assert got == [(1, 4), (1, 0)]


def _stages_with_own_keys(rank: int, world: int, root: str, stage: str) -> tuple[int, int]:
    model = make_model(rank)
    state = {f"model{rank}": model, f"optim{rank}": torch.optim.AdamW(model.parameters())}
    with Checkpointer(root, staging_dir=f"{stage}{rank}", uploader="thread") as ckpt:
        ckpt.save(0, state)
    fresh = make_model(rank + 3)
    restored = {f"model{rank}": fresh, f"optim{rank}": torch.optim.AdamW(fresh.parameters())}
    with Checkpointer(root, staging_dir=f"{stage}{rank}-b", uploader="thread") as ckpt:
        step = ckpt.restore(restored)
    return step, len(restored[f"optim{rank}"].state)


def test_pipeline_stages_with_optimizers_of_their_own_restore_them_unstepped(tmp_path):
    """Each rank's optimizer under a key of its own: "fresh on every rank" was empty, so the
    state DCP made up (step 1, zero moments) was restored as real."""
    assert run_world(_stages_with_own_keys, 2, str(tmp_path / "root"), str(tmp_path / "s")) == [(0, 0), (0, 0)]


def test_a_save_between_backward_and_the_first_step_restores_into_a_fresh_optimizer(tmp_path):
    """With gradients set, DCP gives a fresh optimizer no state to save; a fresh optimizer
    to restore into gets made-up state, so the restore raised StateMismatchError."""
    state = _state(0)
    state["model"](torch.randn(2, 16)).sum().backward()
    grads = [p.grad for p in state["model"].parameters()]
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "a"), uploader="thread") as ckpt:
        ckpt.save(0, state)
    assert all(p.grad is g for p, g in zip(state["model"].parameters(), grads)) and not state["optim"].state
    fresh = _state(1)
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 0
    assert len(fresh["optim"].state) == 0


def test_a_failed_restore_into_a_never_stepped_optimizer_leaves_its_lr_and_grads_alone(tmp_path):
    model = make_model(0)
    saved = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}
    train_steps(model, saved["optim"], 1, rank=0)
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "a"), uploader="thread") as ckpt:
        ckpt.save(1, saved)
    model = make_model(0)
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5)
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        with pytest.raises(Exception):  # noqa: B017 - DCP's own TypeError: LBFGS needs a closure
            ckpt.restore({"model": model, "optim": lbfgs})
    assert lbfgs.param_groups[0]["lr"] == 0.5 and len(lbfgs.state) == 0
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_save_of_a_never_stepped_optimizer_leaves_its_lr_and_grads_alone(tmp_path):
    """DCP steps a fresh optimizer at lr 0 with zero grads to make state to save; LBFGS
    raises there (it needs a closure), and the optimizer was left with lr 0 and zero grads,
    training on at lr 0 until wait() reported the failure."""
    model = make_model(0)
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5)
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(0, {"model": model, "optim": lbfgs})
        assert lbfgs.param_groups[0]["lr"] == 0.5
        assert all(p.grad is None for p in model.parameters()) and len(lbfgs.state) == 0
        with pytest.raises(CheckpointError):
            ckpt.wait()


def test_an_optimizer_that_keeps_no_state_gets_no_made_up_step_at_every_save(tmp_path):
    """SGD without momentum keeps no state, so every save found it fresh and DCP made its
    state up: zero grads for every parameter and a step at lr 0, which ran the user's step
    hooks (an EMA update, a counter) once more at each save. Only the first save does now;
    the weights restored are the ones saved."""
    model = make_model(0)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    optim.register_step_post_hook(lambda *_: steps.append(optim.param_groups[0]["lr"]))
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "a"), uploader="thread") as ckpt:
        for step in range(1, 5):
            train_steps(model, optim, 1, rank=0, start=step)
            optim.zero_grad()  # the usual loop: step, zero_grad, save
            ckpt.save(step, {"model": model, "optim": optim})
            assert all(p.grad is None for p in model.parameters()) and not optim.state
        ckpt.wait()
    assert steps == [0.1, 0.0, 0.1, 0.1, 0.1]  # four real steps, one made-up step (at lr 0)
    saved = [p.detach().clone() for p in model.parameters()]
    fresh = make_model(1)
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1)}) == 4
    assert all(torch.equal(a, b) for a, b in zip(saved, fresh.parameters()))


def test_an_adam_whose_first_step_had_no_grads_still_saves_its_state_and_restores(tmp_path):
    """A step that leaves an optimizer no state marks it as keeping none only when some
    parameter had a grad in it: an Adam over a head that no batch used yet steps with
    every grad None, was marked, and its later saves wrote empty state that a fresh
    process (whose restore makes its state up) refused with StateMismatchError."""
    model, head = make_model(0), torch.nn.Linear(16, 16)
    optim, head_optim = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(head.parameters())
    state = {"model": model, "head": head, "optim": optim, "head_optim": head_optim}
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "a"), uploader="thread") as ckpt:
        assert ckpt.restore(state) is None  # a fresh start: its first-step hooks watch both optimizers
        for step in (1, 2):
            train_steps(model, optim, 1, rank=0, start=step)
            head_optim.step()  # the head is not used yet: no grads, no state
            ckpt.save(step, state)
        ckpt.wait()
    fresh_model, fresh_head = make_model(1), torch.nn.Linear(16, 16)
    fresh = {
        "model": fresh_model,
        "head": fresh_head,
        "optim": torch.optim.AdamW(fresh_model.parameters()),
        "head_optim": torch.optim.AdamW(fresh_head.parameters()),
    }
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))


def test_restore_prefers_verified_local_copy(tmp_path):
    root, stage = str(tmp_path / "root"), str(tmp_path / "stage")
    state = _state(0)
    with Checkpointer(root, staging_dir=stage) as ckpt:
        ckpt.save(1, state)
    with Checkpointer(root, staging_dir=stage) as ckpt:
        assert ckpt.restore(_state(1)) == 1
        assert ckpt.last_restore.local_files > 0 and ckpt.last_restore.remote_files == 0
    # A local copy that no longer matches the manifest is ignored. (Replaced, not written
    # in place: on one file system the staged file and the durable one are a hard link.)
    local = next((tmp_path / "stage").rglob("__0_*.distcp"))
    local.unlink()
    local.write_bytes(b"garbage")
    fresh = _state(2)
    with Checkpointer(root, staging_dir=stage) as ckpt:
        assert ckpt.restore(fresh) == 1
        assert ckpt.last_restore.remote_files > 0
    assert torch.equal(fresh["model"][0].weight, state["model"][0].weight)


def test_no_checkpoint_returns_none(root, tmp_path):
    with Checkpointer(root, staging_dir=str(tmp_path / "s")) as ckpt:
        assert ckpt.restore(_state(0)) is None


def test_retention_keeps_last_and_never_the_newest(tmp_path):
    root = str(tmp_path / "root")
    state = _state(0)
    with Checkpointer(root, keep_last=2, staging_dir=str(tmp_path / "s")) as ckpt:
        for step in (10, 20, 30, 40):
            ckpt.save(step, state)
            ckpt.wait()
        assert ckpt.stats.committed == [10, 20, 30, 40]
    infos = list_checkpoints(root)
    assert [(i.step, i.committed, i.world_size) for i in infos] == [(30, True, 1), (40, True, 1)]
    assert all(i.num_bytes > 0 and i.created for i in infos)


def _damage(root: str, step: int, how: str) -> None:
    loc = _catalog.step_location(resolve(root), step)
    (shard,) = [i.path for i in list_dir(loc) if i.path.rsplit("/", 1)[-1].startswith("__0_")]
    path = shard
    if how == "delete":
        loc.fs.delete_file(path)
        return
    with loc.fs.open_input_file(path) as f:
        data = f.read()
    data = data[: len(data) // 2] if how == "truncate" else data[:-1] + bytes([data[-1] ^ 0xFF])
    with loc.fs.open_output_stream(path) as f:
        f.write(data)


@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
def test_damaged_newest_falls_back_to_previous(root, tmp_path, how, caplog):
    state = _state(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "s")) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        old = state["model"][0].weight.detach().clone()
        train_steps(state["model"], state["optim"], 1, rank=0)
        ckpt.save(2, state)
    _damage(root, 2, how)
    fresh = _state(5)
    with Checkpointer(root, staging_dir=str(tmp_path / "other"), verify_checksums=True) as ckpt:
        assert ckpt.restore(fresh) == 1
    assert torch.equal(fresh["model"][0].weight, old)
    assert "damaged" in caplog.text and "step 2" in caplog.text


def test_a_step_saved_again_in_the_same_run_after_its_commit_was_quarantined_commits(tmp_path):
    """A restore in the run (a rollback) found step 2 damaged, quarantined it and fell back
    to step 1; training reached step 2 again and saved it in the same generation. The
    quarantined commit of that generation outranked the new save, which never committed
    ("every rank's part is durable, yet it did not commit"): a crash then lost every step
    since step 1."""
    root = str(tmp_path / "root")
    state = _state(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        for step in (1, 2):
            train_steps(state["model"], state["optim"], 1, rank=0, start=step)
            ckpt.save(step, state)
            ckpt.wait()
        _damage(root, 2, "flip")  # its size kept: only checksums see it
        assert ckpt.restore(state) == 1  # step 2 quarantined
        train_steps(state["model"], state["optim"], 1, rank=0, start=2)
        ckpt.save(2, state)
        ckpt.wait()
        assert ckpt.stats.committed == [1, 2, 2]
        saved = [p.detach().clone() for p in state["model"].parameters()]
    # The damaged commit's record stays: until the new COMMITTED was written (or after a
    # crash between), a restore finishing the damaged save as an orphan re-committed it
    # uncondemned, ordered before the new save of its generation half of the time.
    step_2 = _catalog.step_location(resolve(root), 2)
    record = read_quarantine(step_2)
    new_commit = read_manifest(step_2)
    assert record is not None and record["digest"] != new_commit.digest
    # A crash between the old COMMITTED's delete and the new one's write: a restore finishes
    # an orphan of step 2, and the damaged save is never the one it commits.
    step_2.fs.delete_file(step_2.join(_layout.COMMITTED))
    damaged = CommitProtocol(step_2, 2, 1, record["nonce"], new_commit.generation)
    assert damaged.finalize().state != "committed"
    assert finish_orphan(step_2, 2).save_id == new_commit.save_id
    fresh = _state(5)
    with Checkpointer(root, staging_dir=str(tmp_path / "other"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 2
    assert all(torch.equal(a, b) for a, b in zip(saved, fresh["model"].parameters()))


def test_a_pick_that_keeps_leaving_storage_during_its_load_raises_an_error_that_names_the_cause(tmp_path, monkeypatch):
    """A restore chooses again when its pick left storage during the load (pruned by a dead
    attempt's late retention), three times at most. Past that it raised the load's own
    error (a bare FileNotFoundError of some shard), not the CheckpointError its docs
    promise, which says what prunes the path and what to do. Here every load finds its
    files gone, as if another process pruned each pick."""
    from ray_goodput.checkpoint.restore import _choose_and_load

    root = str(tmp_path / "root")
    state = _state(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, state)
    loads = []

    def pruned_meanwhile(*args, **kwargs):
        loads.append(1)
        raise FileNotFoundError("__0_0.distcp")

    monkeypatch.setattr(_choose_and_load, "load_checkpoint", pruned_meanwhile)
    monkeypatch.setattr(_choose_and_load, "failed_load_verdict", lambda root, manifest, exc: "gone")
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        with pytest.raises(CheckpointError, match="left storage while it was loaded 4 times"):
            ckpt.restore(_state(1))
    assert len(loads) == 4


@pytest.mark.slow
def test_unreachable_storage_fails_at_creation_naming_the_uri():
    """Also the storage probe's test of a down endpoint: the Checkpointer's creation is
    that probe, and it names the endpoint that refused the connection."""
    port = free_port()  # nothing listens here
    uri = f"s3://bucket/run?endpoint_override=127.0.0.1:{port}&scheme=http"
    with pytest.raises(StorageUnusableError, match=f"127.0.0.1:{port}.*not usable.*nothing accepts connections"):
        Checkpointer(uri)


def _make_with_storage_of_rank(rank: int, world_size: int, uris: list[str], staging: str) -> tuple[str, str]:
    try:
        Checkpointer(uris[rank], staging_dir=f"{staging}/{rank}", uploader="thread")
    except StorageUnusableError as exc:
        return type(exc).__name__, str(exc)
    return "made", ""


def test_a_storage_probe_that_fails_on_one_rank_raises_the_same_error_on_every_rank(tmp_path):
    """Found by a world-2 S3 soak (seed 22, trial 18, flaky storage): one rank's probe
    failed, that rank raised StorageUnusableError in its constructor and exited, and its
    peer went on into its first collective and failed with gloo's "connection closed by
    peer" instead. The probe's outcome is now agreed: every rank raises the failing one's."""
    port = free_port()  # nothing listens here: rank 1's storage is unreachable
    uris = [str(tmp_path / "root"), f"s3://bucket/run?endpoint_override=127.0.0.1:{port}&scheme=http"]
    got = run_world(_make_with_storage_of_rank, 2, uris, str(tmp_path / "s"))
    assert [kind for kind, _ in got] == ["StorageUnreachableError"] * 2, got  # a StorageUnusableError
    assert all(f"127.0.0.1:{port}" in message for _, message in got), got  # rank 1's error, on both


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="keep_last"):
        Checkpointer(str(tmp_path), keep_last=0)
    with pytest.raises(ConfigError, match="storage_path"):
        Checkpointer()  # outside Ray Train there is no run storage to default to
    for bound in (0, float("inf")):  # every wait has a bound (an infinite one overflowed Event.wait)
        with pytest.raises(ConfigError, match="wait_timeout_s must be > 0 and finite"):
            Checkpointer(str(tmp_path), wait_timeout_s=bound)
    with Checkpointer(str(tmp_path), staging_dir=str(tmp_path / "s")) as ckpt:
        with pytest.raises(ConfigError, match="non-empty dict"):
            ckpt.save(1, {})
        ckpt.save(5, _state(0))
        with pytest.raises(ConfigError, match="not after"):
            ckpt.save(5, _state(0))


def test_sync_every_is_validated(tmp_path):
    with pytest.raises(Exception, match="sync_every"):
        Checkpointer(str(tmp_path), sync_every=0, uploader="thread")


def test_state_mismatch_is_not_retryable(tmp_path):
    root = str(tmp_path / "r")
    with Checkpointer(root, staging_dir=str(tmp_path / "s")) as ckpt:
        ckpt.save(1, _state(0))
    other = torch.nn.Linear(3, 3)
    with Checkpointer(root, staging_dir=str(tmp_path / "s")) as ckpt:
        with pytest.raises(StateMismatchError, match="does not match"):
            ckpt.restore({"model": other})


# ---- a crash between shards (real process killed) ---------------------------------------


class _DieBeforeUpload(ThreadBackend):
    """Upload backend of a rank that is SIGKILLed after its shard is written locally."""

    def __init__(self):
        super().__init__(concurrency=1, policy=RetryPolicy())

    def submit(self, job):
        write_local(job)
        kill_self()

    def close(self):
        pass


def _crash_between_shards(rank: int, world: int, root: str, stage: str) -> None:
    model = wrap(make_model(0), "ddp")
    optim = torch.optim.Adam(model.parameters())
    state = {"model": model, "optim": optim}
    ckpt = Checkpointer(root, staging_dir=f"{stage}{rank}")
    ckpt.save(10, state)
    ckpt.wait()
    train_steps(model, optim, 1, rank)
    if rank == 1:
        ckpt._uploader = _DieBeforeUpload()
    ckpt.save(20, state)
    if rank == 0:  # its shard lands; it must never commit without rank 1's
        step_loc = _catalog.step_location(resolve(root), 20)
        wait_for(
            lambda: list_dir(step_loc, _layout.RANKS_DIR), timeout_s=120, what="rank 0's durable marker of step 20"
        )
        kill_self()  # the rest of the job is gone too
    raise AssertionError(f"rank {rank} outlived its injected crash")


def _restore_then_save(rank: int, world: int, root: str, stage: str) -> int:
    model = wrap(make_model(3), "ddp")
    optim = torch.optim.Adam(model.parameters())
    with Checkpointer(root, staging_dir=f"{stage}{rank}", keep_last=5) as ckpt:
        step = ckpt.restore({"model": model, "optim": optim})
        ckpt.save(30, {"model": model, "optim": optim})
    return step


def test_crash_between_shards_is_never_restored_and_is_collected(tmp_path):
    root, stage = str(tmp_path / "root"), str(tmp_path / "stage")
    run_world(_crash_between_shards, 2, root, stage, allow_deaths=True)
    infos = {i.step: i.committed for i in list_checkpoints(root)}
    assert infos == {10: True, 20: False}
    names = {i.path.rsplit("/", 1)[-1] for i in list_dir(_catalog.step_location(resolve(root), 20), recursive=True)}
    assert any(n.startswith("__0_") for n in names) and not any(n.startswith("__1_") for n in names)
    assert run_world(_restore_then_save, 2, root, stage) == [10, 10]
    assert {i.step: i.committed for i in list_checkpoints(root)} == {10: True, 30: True}


def test_a_step_saved_again_after_a_restart_never_mixes_with_the_old_save(tmp_path):
    """An earlier attempt left step 2 half-written (one rank durable); the new attempt
    saves step 2 again: the stale rank's files must not be combined with the new ones."""
    from ray_goodput.checkpoint.protocol._manifest import RankMarker, write_rank_marker
    from ray_goodput.storage import FileEntry

    root = str(tmp_path / "root")
    step_loc = _catalog.step_location(resolve(root), 2)
    write_rank_marker(
        step_loc,
        RankMarker(
            step=2, rank=0, world_size=1, created=1.0, save_id="stale", files=(FileEntry("__0_stale.distcp", 3, 0),)
        ),
    )
    state = _state(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "s")) as ckpt:
        ckpt.save(2, state)
        ckpt.wait()
    manifest = _catalog.read_manifest(step_loc)
    assert manifest.save_id != "stale" and not any("stale" in f.name for f in manifest.files)
    fresh = _state(9)
    with Checkpointer(root, staging_dir=str(tmp_path / "other")) as ckpt:
        assert ckpt.restore(fresh) == 2
    assert torch.equal(fresh["model"][0].weight, state["model"][0].weight)


def test_torn_commit_marker_is_not_a_commit(tmp_path):
    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), keep_last=5) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(step))
            ckpt.wait()
    (tmp_path / "root/checkpoints/step-000000002/COMMITTED").write_text('{"step": 2, "wor')
    assert [(i.step, i.committed) for i in list_checkpoints(root)] == [(1, True), (2, False)]
    with Checkpointer(root, staging_dir=str(tmp_path / "other")) as ckpt:
        assert ckpt.restore(_state(7)) == 1
