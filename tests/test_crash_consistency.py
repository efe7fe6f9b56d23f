"""Crash consistency: each test reproduces one hole of issue 9 with real components (DCP
over gloo, moto's S3 server over HTTP, a local directory) and is named after the failure
it guards against."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs
import pytest
import torch

from ray_goodput import Checkpointer, list_checkpoints
from ray_goodput.checkpoint.protocol import _catalog, _layout, _lineage, _retention
from ray_goodput.checkpoint.protocol._commit import CommitProtocol
from ray_goodput.checkpoint.protocol._dcp_parts import part_file
from ray_goodput.checkpoint.protocol._manifest import read_manifest, read_rank_marker
from ray_goodput.checkpoint.uploader import _actor
from ray_goodput.checkpoint.uploader._thread_backend import ThreadBackend
from ray_goodput.errors import FencedError, IncompleteSaveError, StorageError
from ray_goodput.runtime import _services
from ray_goodput.runtime._resume import ResumeDecision, root_key, set_decision
from ray_goodput.storage import RetryPolicy, list_dir, resolve, upload_file
from ray_goodput.testing import FlakyProxy, run_world, wait_for
from tests._models import make_model, train_steps, wrap


def _state(seed: int) -> dict:
    model = make_model(seed)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def _weight(state: dict) -> torch.Tensor:
    return state["model"][0].weight.detach().clone()


def _save(root: str, stage: str, steps: list[int], seed: int = 0, keep_last: int = 5) -> dict[int, torch.Tensor]:
    """One attempt: save ``steps`` (a training step between saves); weights saved per step."""
    state, saved = _state(seed), {}
    with Checkpointer(root, staging_dir=stage, keep_last=keep_last, uploader="thread") as ckpt:
        for step in steps:
            train_steps(state["model"], state["optim"], 1, rank=0)
            ckpt.save(step, state)
            ckpt.wait()
            saved[step] = _weight(state)
    return saved


def _flip(root: str, step: int, prefix: str = "__0_") -> None:
    loc = _catalog.step_location(resolve(root), step)
    (path,) = [i.path for i in list_dir(loc, recursive=True) if f"/{prefix}" in i.path]
    with loc.fs.open_input_file(path) as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    with loc.fs.open_output_stream(path) as f:
        f.write(bytes(data))


def _committed(root: str) -> list[int]:
    return [i.step for i in list_checkpoints(root) if i.committed]


# ---- hole 1: lineage order, quarantine, re-saved steps ----------------------------------


def test_keep_last_1_after_falling_back_from_a_damaged_checkpoint_does_not_delete_new_commits(tmp_path):
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [10, 20], keep_last=1)
    _flip(root, 20)
    state = _state(7)
    with Checkpointer(
        root, staging_dir=str(tmp_path / "b"), keep_last=1, uploader="thread", verify_checksums=True
    ) as ckpt:
        assert ckpt.restore(state) is None  # 10 went by keep_last=1; 20 is damaged
        ckpt.save(11, state)
        ckpt.wait()  # raised "step 11 did not commit" when retention deleted it at once
        assert ckpt.stats.committed == [11]
    assert _committed(root) == [11]
    with Checkpointer(root, staging_dir=str(tmp_path / "c"), uploader="thread") as ckpt:
        assert ckpt.restore(_state(3)) == 11


def test_a_restore_that_falls_back_to_nothing_leaves_the_fresh_state_untouched(tmp_path):
    """Found by the chaos soak (seed 0, trial 16): the only commit's RNG extras are damaged;
    restore loaded the weights, then met the damage and returned None with the live state
    already changed, so the run 'started fresh' from the damaged checkpoint's weights."""
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [4], keep_last=1)
    _flip(root, 4, prefix="extras/")
    state = _state(7)
    fresh = _weight(state)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), keep_last=1, uploader="thread") as ckpt:
        assert ckpt.restore(state) is None
    assert torch.equal(_weight(state), fresh)


def test_a_restore_that_falls_back_to_nothing_leaves_a_fresh_optimizer_unstepped(tmp_path):
    """Found by the 200-trial chaos soak (seed 0, trial 16): the only commit's shard file is
    damaged; building the state dict to load into had initialized the fresh AdamW's state
    (step 1, zero moments), so after restore returned None the run's first step used the
    bias correction of step 2 and every weight differed from a fresh start."""

    def adamw(seed: int) -> dict:
        model = make_model(seed)
        return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.1)}

    root = str(tmp_path / "root")
    saved = adamw(0)
    train_steps(saved["model"], saved["optim"], 1, rank=0)
    with Checkpointer(root, staging_dir=str(tmp_path / "a"), keep_last=1, uploader="thread") as ckpt:
        ckpt.save(4, saved)
    _flip(root, 4)
    state = adamw(7)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), keep_last=1, uploader="thread") as ckpt:
        assert ckpt.restore(state) is None
    assert len(state["optim"].state) == 0, dict(state["optim"].state)


def _save_sharded(rank: int, world: int, root: str, stage: str) -> None:
    model = wrap(make_model(0), "fsdp")  # every tensor has a shard in each rank's file
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    train_steps(model, optim, 1, rank)
    with Checkpointer(root, staging_dir=f"{stage}{rank}", keep_last=1, uploader="thread") as ckpt:
        ckpt.save(4, {"model": model, "optim": optim})


def test_a_damaged_second_shard_file_fails_the_restore_before_the_first_is_loaded_in_place(tmp_path):
    """Resharding 2 -> 1 reads both ranks' files into the live tensors, one file after the
    other: each file was checked only when DCP opened it, so a damaged second file was found
    after the first had been copied into the weights."""
    root = str(tmp_path / "root")
    run_world(_save_sharded, 2, root, str(tmp_path / "a"))
    _flip(root, 4, prefix="__1_")
    state = _state(7)
    fresh = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        assert ckpt.restore(state) is None
    changed = [k for k, v in state["model"].state_dict().items() if not torch.equal(v, fresh[k])]
    assert changed == []


def test_damaged_checkpoint_is_quarantined_listed_as_damaged_and_removed_by_retention(tmp_path, capsys):
    from argparse import Namespace

    from ray_goodput.cli._checkpoints import cmd_ls

    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [10, 20])
    _flip(root, 20)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread", verify_checksums=True) as ckpt:
        assert ckpt.restore(_state(1)) == 10
    info = {i.step: i for i in list_checkpoints(root)}
    assert not info[20].committed and info[20].damaged and info[20].state == "damaged"
    assert read_manifest(_catalog.step_location(resolve(root), 20)) is not None  # kept for inspection
    # Without checksums the quarantine still holds: it is never restored again.
    with Checkpointer(root, staging_dir=str(tmp_path / "c"), uploader="thread") as ckpt:
        assert ckpt.restore(_state(1)) == 10
    cmd_ls(Namespace(uri=root))
    rows = [ln.split()[:2] for ln in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["10", "committed"], ["20", "damaged"]]
    _save(root, str(tmp_path / "d"), [11], keep_last=1)
    assert [i.step for i in list_checkpoints(root)] == [11]


def test_a_step_saved_again_after_a_restart_commits_the_new_save_not_the_damaged_one(tmp_path):
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [10, 20])
    _flip(root, 20)
    old = read_manifest(_catalog.step_location(resolve(root), 20))
    state = _state(5)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread", verify_checksums=True) as ckpt:
        assert ckpt.restore(state) == 10
        train_steps(state["model"], state["optim"], 3, rank=0)
        ckpt.save(20, state)
        ckpt.wait()
        assert ckpt.stats.committed == [20]
    new = read_manifest(_catalog.step_location(resolve(root), 20))
    assert new.save_id != old.save_id and new.generation > old.generation
    fresh = _state(9)
    with Checkpointer(root, staging_dir=str(tmp_path / "c"), uploader="thread", verify_checksums=True) as ckpt:
        assert ckpt.restore(fresh) == 20
    assert torch.equal(_weight(fresh), _weight(state))


def test_a_dead_attempts_late_commit_of_a_higher_step_never_outranks_the_live_attempt(tmp_path):
    root = str(tmp_path / "root")
    dead = Checkpointer(root, staging_dir=str(tmp_path / "a"), uploader="thread", keep_last=2)
    state = _state(0)
    dead.save(10, state)
    dead.wait()
    live_state = _state(1)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread", keep_last=2) as live:
        assert live.restore(live_state) == 10
        train_steps(live_state["model"], live_state["optim"], 1, rank=0)
        live.save(15, live_state)
        live.wait()
        dead.save(30, state)  # the dead attempt's uploader commits late
        with pytest.raises(FencedError):  # what a zombie of the dead attempt would hear
            dead.wait()
        live.save(16, live_state)
        live.wait()
    dead.close()
    assert 15 in _committed(root) and 16 in _committed(root)
    with Checkpointer(root, staging_dir=str(tmp_path / "c"), uploader="thread") as ckpt:
        assert ckpt.restore(_state(2)) == 16  # by step alone, 30 was "newest"


def test_the_step_the_driver_chose_survives_the_dead_attempts_late_commits_and_their_retention(tmp_path):
    """Found by the S3 Poisson benchmark at 256 MiB: the driver chose step 70, then the dead
    attempt's uploader committed 83 and 96 and its keep_last=2 retention deleted 70, so the
    new attempt found its chosen step gone and restarted from step 0."""
    root = str(tmp_path / "root")
    state = _state(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "a"), keep_last=2, uploader="thread") as dead:
        dead.save(10, state)
        dead.wait()
        _lineage.pin_resume(resolve(root), attempt=2, step=10)  # the Recovery's decision for attempt 2
        for step in (20, 30):  # the dead attempt's uploader commits late, and prunes to keep_last
            dead.save(step, state)
            dead.wait()
    assert 10 in _committed(root)
    set_decision(ResumeDecision(attempt=2, step=10, root_key=root_key(root)))
    try:
        with Checkpointer(root, staging_dir=str(tmp_path / "c"), uploader="thread") as ckpt:
            assert ckpt.restore(_state(3)) == 10
    finally:
        set_decision(None)


def test_a_restore_skips_a_directory_whose_deletion_was_cut_short_instead_of_raising(tmp_path):
    """Found by the CI soak (seed 11, trial 16): a directory whose COMMITTED was deleted but
    not yet all of its files (retention killed mid-deletion, or a live retention pruning it
    while a dead attempt's uploader finished it) still had every rank's marker; finishing
    that orphan raised "declared durable are missing" out of restore instead of skipping it."""
    root = str(tmp_path / "root")
    saved = _save(root, str(tmp_path / "a"), [10, 20])
    loc = _catalog.step_location(resolve(root), 20)
    loc.fs.delete_file(loc.join(_layout.COMMITTED))
    (extras,) = [i.path for i in list_dir(loc, recursive=True) if "/extras/" in i.path]
    loc.fs.delete_file(extras)
    state = _state(4)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        assert ckpt.restore(state) == 10
    assert torch.equal(_weight(state), saved[10])


def test_an_orphan_whose_metadata_part_went_after_the_presence_check_is_skipped_not_raised(tmp_path):
    """The same deletion racing the commit check: a rank's metadata part went between the
    presence check and the merge of ``.metadata``; FileNotFoundError escaped restore."""
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [10, 20])
    loc = _catalog.step_location(resolve(root), 20)
    manifest = read_manifest(loc)
    loc.fs.delete_file(loc.join(_layout.COMMITTED))
    protocol = CommitProtocol(loc, 20, 1, manifest.save_id, manifest.generation)
    loc.fs.delete_file(loc.join(part_file(0, manifest.save_id)))
    marker = read_rank_marker(loc, 0, manifest.save_id)
    with ThreadPoolExecutor(1) as pool:  # the commit reads the parts beside the presence check
        parts = {0: pool.submit(protocol._read_part, 0, None)}
        with pytest.raises(IncompleteSaveError):
            protocol._merged_metadata(parts, {0: marker})


def test_finishing_an_orphan_whose_commit_write_retention_prunes_is_skipped_not_raised(tmp_path, monkeypatch):
    """Found by the CI soak (seed 11, trial 16, again): while restore's catalog finished an
    orphan, the live attempt's retention deleted the listed ``COMMITTED.tmp-…`` of that
    commit's write (it carries no save id), and the rename's FileNotFoundError came out of
    restore as a StorageError."""
    from ray_goodput.storage import _transfer

    root = str(tmp_path / "root")
    saved = _save(root, str(tmp_path / "a"), [10, 20])
    loc = _catalog.step_location(resolve(root), 20)
    loc.fs.delete_file(loc.join(_layout.COMMITTED))
    real = _transfer.fsync_file

    def pruned_meanwhile(path):  # the retention pass, between the write and the rename
        if "COMMITTED.tmp-" in str(path):
            os.unlink(path)
        return real(path)

    monkeypatch.setattr(_transfer, "fsync_file", pruned_meanwhile)
    state = _state(4)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        assert ckpt.restore(state) == 10
    assert torch.equal(_weight(state), saved[10])


def test_a_dead_attempts_late_commit_never_prunes_where_the_live_attempt_may_upload(tmp_path):
    """A dead attempt's uploader that commits late used to apply its own keep_last: it
    deleted directories the live attempt was about to upload into (here step 30, its own
    late commit), failing the live attempt's save there. Pruning is the live attempt's."""
    root = str(tmp_path / "root")
    state = _state(0)
    dead = Checkpointer(root, staging_dir=str(tmp_path / "a"), uploader="thread", keep_last=1)
    dead.save(10, state)
    dead.wait()
    live_state = _state(1)
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread", keep_last=3) as live:
        assert live.restore(live_state) == 10
        live.save(20, live_state)
        live.wait()
        dead.save(30, state)  # late, and keep_last=1 by its own lights
        with pytest.raises(FencedError):  # committed, then fenced: the live attempt saves here
            dead.wait()
        assert [i.step for i in list_checkpoints(root)] == [10, 20, 30]
        live.save(30, live_state)
        live.wait()
        assert live.stats.committed == [20, 30] and live.stats.failed_saves == 0
    dead.close()
    assert _committed(root) == [10, 20, 30]
    assert read_manifest(_catalog.step_location(resolve(root), 30)).generation == live.generation


def test_retention_after_a_commit_never_deletes_what_another_rank_uploaded_since_its_listing(tmp_path):
    """Found by the CI soak: a rank's retention after a commit judged a directory above
    that commit from its listing. One holding only a dead attempt's save looked settled and
    was deleted whole, with the file another rank of the live attempt had uploaded into it
    after the listing; that save then failed with "declared durable are missing"."""
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [10, 30], keep_last=5)
    try:
        set_decision(ResumeDecision(attempt=5, step=10, root_key=root_key(root)))
        with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread", keep_last=5) as live:
            assert live.restore(_state(2)) == 10
            live.save(20, _state(2))
            live.wait()
            assert live.generation == 5
    finally:
        set_decision(None)
    loc = _catalog.step_location(resolve(root), 30)
    (tmp_path / "shard").write_bytes(b"a shard of step 30")
    early = f"__1_{_layout.save_id(5, 'abcdef12')}.distcp"
    upload_file(tmp_path / "shard", loc, early)  # rank 1's, before the listing ...
    listed = _catalog.scan(resolve(root))  # ... rank 0's retention lists after committing 20 ...
    late = f"__2_{_layout.save_id(5, 'abcdef12')}.distcp"
    upload_file(tmp_path / "shard", loc, late)  # ... rank 2 uploads its step-30 shard ...
    assert _retention._prune(resolve(root), listed, 1, 5) == [10, 30]  # ... then rank 0 prunes
    assert _files(loc) == sorted([early, late])
    assert [(i.step, i.committed) for i in list_checkpoints(root)] == [(20, True), (30, False)]
    assert not (tmp_path / "root" / "checkpoints" / _layout.step_dir(10)).exists()


def _files(loc) -> list[str]:
    return sorted(i.path[len(loc.root) + 1 :] for i in list_dir(loc, recursive=True) if i.type == pafs.FileType.File)


def test_a_dead_attempts_retention_from_a_stale_listing_deletes_only_what_it_listed(tmp_path):
    """A dead attempt's uploader committing late prunes from one listing; the new attempt
    may claim its generation just after the check and upload into a directory that
    listing doomed (it resumed below it). That directory used to be deleted whole."""
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [10, 20, 30], keep_last=5)
    dead = _catalog.scan(resolve(root))[0].manifest.generation
    listed = _catalog.scan(resolve(root))
    loc = _catalog.step_location(resolve(root), 20)
    (tmp_path / "shard").write_bytes(b"the new attempt's shard of step 20")
    live = f"__0_{_layout.save_id(dead + 1, 'abcdef12')}.distcp"
    upload_file(tmp_path / "shard", loc, live)
    assert _retention._prune(resolve(root), listed, 1, dead) == [10, 20]
    assert _files(loc) == [live]
    assert not (tmp_path / "root" / "checkpoints" / _layout.step_dir(10)).exists()
    assert _committed(root) == [30]


def test_retention_from_a_stale_listing_leaves_a_directory_committed_again_since_intact(tmp_path):
    """``.metadata`` carries no save id: deleting the listed one of a directory that was
    committed again since the listing deleted the new commit's, and that commit read as
    damaged."""
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [10, 20, 30], keep_last=5)
    listed = _catalog.scan(resolve(root))
    try:
        set_decision(ResumeDecision(attempt=5, step=10, root_key=root_key(root)))
        with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread", keep_last=5) as live:
            assert live.restore(_state(2)) == 10
            live.save(20, _state(2))  # 20 committed again, by generation 5
            live.wait()
    finally:
        set_decision(None)
    assert _retention._prune(resolve(root), listed, 1, None) == [10]
    loc = _catalog.step_location(resolve(root), 20)
    manifest = read_manifest(loc)
    assert manifest.generation == 5 and _catalog.verify(loc, manifest, checksums=True) == []


def test_retention_never_deletes_the_metadata_of_a_commit_that_lands_above_its_newest(tmp_path):
    """Found by a world-2 S3 soak (seed 53, trial 4): two ranks finalized step 6 at once;
    one deleted the COMMITTED the other had just written (it had read "none" a moment
    before), and the other's retention, listing in that moment, saw step 6 above its newest
    commit and deleted the listed ``.metadata`` as a dead generation's file (it carries no
    save id). Step 6 was then committed without it: damaged."""
    root = str(tmp_path / "root")
    try:
        set_decision(ResumeDecision(attempt=5, step=None, root_key=root_key(root)))
        _save(root, str(tmp_path / "a"), [20, 30], keep_last=5)
    finally:
        set_decision(None)
    loc = _catalog.step_location(resolve(root), 30)
    committed = loc.fs.open_input_file(loc.join(_layout.COMMITTED)).read()
    loc.fs.delete_file(loc.join(_layout.COMMITTED))  # the racing finalizer's delete ...
    listed = _catalog.scan(resolve(root))  # ... the retention lists in that moment ...
    _retention._prune(resolve(root), listed, 1, 5)  # ... and prunes before ...
    with loc.fs.open_output_stream(loc.join(_layout.COMMITTED)) as out:
        out.write(committed)  # ... the commit lands again
    manifest = read_manifest(loc)
    assert manifest.generation == 5 and _catalog.verify(loc, manifest, checksums=True) == []


def test_a_dead_attempts_retention_stops_once_a_newer_generation_is_claimed(tmp_path):
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "a"), [10, 20, 30], keep_last=5)
    dead = _catalog.scan(resolve(root))[0].manifest.generation
    listed = _catalog.scan(resolve(root))
    _lineage.claim(resolve(root), None)  # the new attempt starts
    assert _retention._prune(resolve(root), listed, 1, dead) == []
    assert _committed(root) == [10, 20, 30]


def test_the_driver_pin_holds_on_a_storage_root_an_earlier_run_used(tmp_path):
    """The Recovery pinned its own attempt number (1, 2, ...) and the pin lapsed at any
    commit of that generation or newer; on a root an earlier run had used, generations run
    ahead of attempts, so the dead attempt's own commits lapsed it and its late retention
    deleted the step the new attempt was told to resume from."""
    root = str(tmp_path / "root")
    _save(root, str(tmp_path / "old-run"), [5], keep_last=5)  # an earlier job: generation 1
    state = _state(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "a"), keep_last=1, uploader="thread") as dead:
        dead.save(10, state)  # this run's attempt 1: generation 2
        dead.wait()
        dead.save(20, state)
        dead.wait()
        pin = _lineage.next_generation(resolve(root), 2)  # what the Recovery pins for attempt 2
        _lineage.pin_resume(resolve(root), attempt=pin, step=20)
        dead.save(30, state)  # the dead attempt's uploader commits late, keep_last=1
        dead.wait()
    assert _committed(root) == [20, 30]


def test_restore_loads_exactly_the_step_the_driver_chose_never_a_newer_one(tmp_path):
    root = str(tmp_path / "root")
    saved = _save(root, str(tmp_path / "a"), [10, 20, 30])
    _flip(root, 20)
    try:
        set_decision(ResumeDecision(attempt=7, step=20, root_key=root_key(root)))
        state = _state(4)
        with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread", verify_checksums=True) as ckpt:
            assert ckpt.restore(state) == 10  # 20 damaged: the previous one, never 30
            ckpt.save(11, state)  # the generation is agreed at the first save
            assert ckpt.generation >= 7
        assert torch.equal(_weight(state), saved[10])
        set_decision(ResumeDecision(attempt=8, step=None, root_key=root_key(root)))
        with Checkpointer(root, staging_dir=str(tmp_path / "c"), uploader="thread") as ckpt:
            assert ckpt.restore(_state(4)) is None
    finally:
        set_decision(None)


# ---- hole 2: saves faster than uploads ---------------------------------------------------


def test_three_saves_then_wait_with_keep_last_2_do_not_fail_when_retention_removed_the_first(tmp_path):
    root = str(tmp_path / "root")
    state = _state(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), keep_last=2, uploader="thread") as ckpt:
        for step in (1, 2, 3):
            train_steps(state["model"], state["optim"], 1, rank=0)
            ckpt.save(step, state)
        ckpt.wait()  # raised "step 1 did not commit": it re-read storage after retention
        assert sorted(ckpt.stats.committed + ckpt.stats.superseded) == [1, 2, 3]
        assert ckpt.stats.committed[-1] == 3 and ckpt.stats.failed_saves == 0
    assert _committed(root)[-1] == 3


@pytest.fixture
def slow_s3(s3_server):
    proxy = FlakyProxy(s3_server.endpoint)
    bucket = s3_server.bucket_uri("run")
    yield proxy, bucket.replace(s3_server.endpoint, proxy.endpoint)
    proxy.close()


def test_an_orphan_that_restore_commits_is_restored_not_quarantined_by_a_listing_older_than_its_commit(tmp_path):
    """Restore checked sizes against the listing that found the orphan, taken before it
    wrote the orphan's .metadata and COMMITTED: a good checkpoint was quarantined."""
    from pathlib import Path

    root = str(tmp_path / "root")
    model = torch.nn.Linear(8, 8)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": model})
            ckpt.wait()
    step2 = Path(_catalog.step_location(resolve(root), 2).root)
    (step2 / _layout.COMMITTED).unlink()  # the committer died after every rank's marker
    (step2 / _layout.DCP_METADATA).unlink()
    fresh = torch.nn.Linear(8, 8)
    with Checkpointer(root, staging_dir=str(tmp_path / "fresh"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh}) == 2
    assert not (step2 / _layout.QUARANTINED).exists()
    assert torch.equal(fresh.weight, model.weight)


def test_restore_never_waits_for_the_generation_claim_and_the_pin_names_the_claimed_generation(
    s3_server, slow_s3, tmp_path
):
    """A Checkpointer made just before restore waited for its claim's two requests and only
    then listed storage; later rank 0 chose while the claim was in flight but still waited
    for it before the load (0-30 ms of a 60 ms restore from the node-local copy on the S3
    server, more while a restore from storage kept the server busy). Restore now never
    waits for it: the generation is agreed at the first save, as at a fresh start, and the
    resume pin is written once the claim landed, naming the claimed generation (a pin
    naming an older one would lapse at once and let a dead attempt's late commit prune the
    resume step)."""
    import json

    from ray_goodput.storage import read_bytes

    proxy, uri = slow_s3
    # Reads the proxy does not hold, with a client made first (making one while a request
    # is held waited here for that request's retries, ~45 s).
    direct = resolve(uri.replace(proxy.endpoint, s3_server.endpoint))
    saved = _save(uri, str(tmp_path / "a"), [10])
    proxy.stall(_layout.GENERATION, methods=("PUT",))  # the new attempt's claim is held
    state = _state(3)
    try:
        with Checkpointer(uri, staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
            wait_for(lambda: proxy.holding(_layout.GENERATION), timeout_s=30, what="the claim's write, held")
            assert ckpt.restore(state) == 10
            assert torch.equal(_weight(state), saved[10])
            assert ckpt.generation is None and _lineage.claimed_generation(direct) == 1
            assert not proxy.count(_layout.RESUME, ("PUT",))  # the pin waits for the claim
            proxy.release()
            ckpt.save(11, state)
            assert ckpt.generation == 2
    finally:
        proxy.release()
    pin = json.loads(read_bytes(_catalog.checkpoints_location(direct), _layout.RESUME))
    assert pin == {"attempt": 2, "step": 10}


def test_a_checkpoint_pruned_between_restores_choice_and_its_load_is_chosen_again_not_raised(
    s3_server, slow_s3, tmp_path
):
    """A dead attempt's late retention pass can delete the directory restore just chose
    (it read the claimed generation before this attempt's claim landed). The load then
    found its files gone and restore raised on every rank, failing the attempt; now rank 0
    sees the commit gone and every rank chooses again (no quarantine: nothing is damaged)."""
    import threading

    proxy, uri = slow_s3
    direct = resolve(uri.replace(proxy.endpoint, s3_server.endpoint))
    run_world(_save_two, 2, uri, str(tmp_path / "a"))
    commit_20 = f"{_layout.step_dir(20)}/{_layout.COMMITTED}"
    proxy.stall(commit_20)  # rank 0's read of step 20's manifest, while choosing, held half-way
    got: list = []
    restoring = threading.Thread(
        target=lambda: got.append(run_world(_restore_fresh, 2, uri, str(tmp_path / "fresh"), timeout_s=120))
    )
    restoring.start()
    # Held once the server answered it: the choice reads the commit as it was.
    wait_for(lambda: proxy.holding(commit_20), timeout_s=60, what="rank 0 reading step 20's manifest")
    step_20 = _catalog.step_location(direct, 20)
    step_20.fs.delete_file(step_20.join(_layout.COMMITTED))  # pruned: the commit first
    step_20.fs.delete_dir(step_20.root)
    proxy.release()
    restoring.join(150)
    assert not restoring.is_alive() and got == [[10, 10]]
    assert not [i for i in list_dir(direct, recursive=True) if i.path.endswith(_layout.QUARANTINED)]


def test_a_pick_that_left_storage_with_nothing_left_to_fall_back_to_raises_instead_of_starting_fresh(
    s3_server, slow_s3, tmp_path
):
    """Choosing again after the pick left storage kept the fall-back bounds; finding
    nothing within them returned None, and the attempt trained from scratch although
    a newer commit (the one whose retention pruned the pick) may exist."""
    import threading

    from ray_goodput.errors import CheckpointError

    proxy, uri = slow_s3
    direct = resolve(uri.replace(proxy.endpoint, s3_server.endpoint))
    _save(uri, str(tmp_path / "a"), [20])
    commit_20 = f"{_layout.step_dir(20)}/{_layout.COMMITTED}"
    proxy.stall(commit_20)
    state, errors = _state(3), []
    before = _weight(state)

    def restore() -> None:
        try:
            ckpt.restore(state)
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    with Checkpointer(uri, staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        restoring = threading.Thread(target=restore)
        restoring.start()
        wait_for(lambda: proxy.holding(commit_20), timeout_s=30, what="restore reading step 20's manifest")
        step_20 = _catalog.step_location(direct, 20)
        step_20.fs.delete_file(step_20.join(_layout.COMMITTED))
        step_20.fs.delete_dir(step_20.root)
        proxy.release()
        restoring.join(60)
        assert not restoring.is_alive()
    assert len(errors) == 1 and type(errors[0]) is CheckpointError, errors
    assert "left storage while it was loaded" in str(errors[0])
    assert torch.equal(_weight(state), before)  # untouched


def test_saves_faster_than_uploads_supersede_the_waiting_one_and_commit_the_newest(slow_s3, tmp_path):
    proxy, uri = slow_s3
    state = _state(0)
    with Checkpointer(uri, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        proxy.stall("step-000000001/", methods=("PUT",))  # step 1's upload hangs
        weights = {}
        for step in (1, 2, 3):
            train_steps(state["model"], state["optim"], 1, rank=0)
            ckpt.save(step, state)  # never waits for step 1's upload
            weights[step] = _weight(state)
            if step == 1:  # running, not waiting (else save 2 supersedes it in the lane)
                wait_for(lambda: proxy.holding_in("step-000000001/"), timeout_s=30, what="step 1's upload")
        proxy.release()
        ckpt.wait()
        assert ckpt.stats.committed == [1, 3] and ckpt.stats.superseded == [2]
        assert ckpt.stats.failed_saves == 0
    assert _committed(uri) == [1, 3]
    assert not [i for i in list_checkpoints(uri) if i.step == 2]  # never written
    fresh = _state(9)
    with Checkpointer(uri, staging_dir=str(tmp_path / "o"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 3
    assert torch.equal(_weight(fresh), weights[3])


# ---- hole 3: a queued job's snapshot must not vanish -------------------------------------


def test_leaving_the_with_block_on_an_error_does_not_lose_a_snapshot_queued_in_the_uploader(
    ray_local, slow_s3, tmp_path
):
    """The node uploader (an actor) outlives the worker's ``with`` block, which unlinks the
    arenas on the way out; the queued job must still write the snapshot it accepted."""
    proxy, uri = slow_s3
    state = _state(0)
    with pytest.raises(RuntimeError, match="training blew up"):
        with Checkpointer(uri, staging_dir=str(tmp_path / "s"), uploader="actor") as ckpt:
            proxy.stall("step-000000001/", methods=("PUT",))
            ckpt.save(1, state)
            # Running, not waiting (else save 2 supersedes it in the uploader's lane).
            wait_for(lambda: proxy.holding_in("step-000000001/"), timeout_s=30, what="step 1's upload")
            train_steps(state["model"], state["optim"], 1, rank=0)
            ckpt.save(2, state)  # queued in the uploader behind step 1's upload
            expected = _weight(state)
            raise RuntimeError("training blew up")  # unlinks the arenas
    proxy.release()
    wait_for(
        lambda: _committed(uri) == [1, 2],
        timeout_s=90,
        what="steps 1 and 2 committed by the node uploader after the worker left",
    )
    # Their outcomes had nobody to go to: the worker said it left for good, so the uploader
    # keeps nothing for it and exits (it kept them for as long as this process lived).
    node = _services.current_node_id()
    wait_for(
        lambda: node not in _services.find(_actor.KIND),
        timeout_s=60,
        what="the node uploader exiting after its only worker left for good",
    )
    fresh = _state(9)
    with Checkpointer(uri, staging_dir=str(tmp_path / "o"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 2
    assert torch.equal(_weight(fresh), expected)


# ---- hole 4: collective calls agree ------------------------------------------------------


def _save_two(rank: int, world: int, root: str, stage: str) -> None:
    model = wrap(make_model(0), "ddp")
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    with Checkpointer(root, staging_dir=f"{stage}{rank}", uploader="thread") as ckpt:
        for step in (10, 20):
            train_steps(model, state["optim"], 1, rank)
            ckpt.save(step, state)
            ckpt.wait()


def _restore_fresh(rank: int, world: int, root: str, stage: str) -> int | None:
    model = wrap(make_model(5), "ddp")
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    with Checkpointer(root, staging_dir=f"{stage}{rank}", uploader="thread") as ckpt:
        return ckpt.restore(state)


def test_restore_with_one_ranks_rng_blob_damaged_falls_back_on_every_rank(tmp_path):
    root, stage = str(tmp_path / "root"), str(tmp_path / "stage")
    run_world(_save_two, 2, root, stage)
    _flip(root, 20, prefix="extras/rank-00001-")  # rank 1's RNG states, same size
    # Fresh staging dirs: every file comes from storage and is checked on the way.
    assert run_world(_restore_fresh, 2, root, str(tmp_path / "fresh"), timeout_s=90) == [10, 10]


def _restore_with_planning_failing_on_rank_1(rank: int, world: int, root: str, stage: str) -> dict:
    """DCP plans each rank's reads alone now: a rank whose planning fails skips the read
    where its peers agree on their files, so it must join that agreement itself."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    real = DefaultLoadPlanner.create_local_plan

    def failing(self):
        raise RuntimeError("planning failed (injected)")

    if rank == 1:
        DefaultLoadPlanner.create_local_plan = failing
    model = wrap(make_model(5), "ddp")
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    before = model.module[0].weight.detach().clone()
    with Checkpointer(root, staging_dir=f"{stage}{rank}", uploader="thread") as ckpt:
        try:
            ckpt.restore(state)
            error = "no error"
        except Exception as exc:  # noqa: BLE001 - compared across ranks
            error = f"{type(exc).__name__}: {exc}"
        untouched = torch.equal(before, model.module[0].weight)
        DefaultLoadPlanner.create_local_plan = real
        again = ckpt.restore(state)  # the ranks are still at the same collectives
    return {"error": error, "untouched": untouched, "again": again}


def test_one_rank_failing_in_dcp_planning_raises_the_same_error_on_every_rank_and_nothing_hangs(tmp_path):
    root, stage = str(tmp_path / "root"), str(tmp_path / "stage")
    run_world(_save_two, 2, root, stage)
    out = run_world(_restore_with_planning_failing_on_rank_1, 2, root, str(tmp_path / "fresh"), timeout_s=120)
    assert out[0]["error"] == out[1]["error"] and "planning failed (injected)" in out[0]["error"], out
    assert out[0]["error"].startswith("CheckpointError: rank 1: "), out  # DCP alone names rank 0
    assert [r["again"] for r in out] == [20, 20] and all(r["untouched"] for r in out), out


class _RefusingBackend(ThreadBackend):
    """A rank whose uploader cannot be reached."""

    def submit(self, job):
        raise StorageError("uploader unreachable (injected by the test)")


def _one_rank_fails(rank: int, world: int, root: str, stage: str) -> str:
    model = wrap(make_model(0), "ddp")
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    backend = _RefusingBackend(concurrency=1, policy=RetryPolicy()) if rank == 1 else "thread"
    with Checkpointer(root, staging_dir=f"{stage}{rank}", uploader=backend) as ckpt:
        ckpt.save(10, state)
        try:
            ckpt.wait()
        except Exception as exc:  # noqa: BLE001 - compared across ranks
            return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_wait_raises_the_same_error_on_every_rank_when_one_ranks_save_failed(tmp_path):
    out = run_world(_one_rank_fails, 2, str(tmp_path / "root"), str(tmp_path / "s"), timeout_s=90)
    assert out[0] == out[1] and "uploader unreachable" in out[0], out
    assert out[0].startswith("CheckpointError")


# ---- hole 5: fsync before the markers ----------------------------------------------------


def test_files_and_directories_are_fsynced_before_the_rank_marker_and_committed(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, _state(0))
        ckpt.wait()
    step_dir = str(_catalog.step_location(resolve(root), 1).root)
    manifest = read_manifest(_catalog.step_location(resolve(root), 1))
    where = {p: i for i, p in enumerate(synced)}
    marker = next(i for i, p in enumerate(synced) if f"/{_layout.RANKS_DIR}/" in p)
    committed = next(i for i, p in enumerate(synced) if p.rsplit("/", 1)[-1].startswith(_layout.COMMITTED))
    ranks_dir = max(i for i, p in enumerate(synced) if p == f"{step_dir}/{_layout.RANKS_DIR}")
    for entry in manifest.files:  # fsynced before it is renamed into place: under its temp name
        if entry.name != _layout.DCP_METADATA:
            final = f"{step_dir}/{entry.name}"
            first = min(i for p, i in where.items() if p == final or p.startswith((f"{final}.part-", f"{final}.link-")))
            assert first < marker, entry.name
    assert max(i for i, p in enumerate(synced) if p == step_dir) > committed
    assert marker < ranks_dir < committed
