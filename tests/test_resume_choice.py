"""The driver's resume choice: made when a failure is seen, handed to the next worker group
(and only to the attempt it was made for), bounded by ``upload_wait_s``, and stopped at the
run's end. Restores later in an attempt choose for themselves."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import ray
import torch
from ray.train import ScalingConfig

from ray_goodput.driver._record import load_state
from ray_goodput.driver._recovery import Recovery
from ray_goodput.runtime import _resume
from ray_goodput.testing import wait_for


def test_the_resume_choice_waits_for_uploads_as_long_as_recovery_was_told(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "30")  # the hook sets it otherwise
    for given, expected in (({}, 120.0), ({"upload_wait_s": 7.5}, 7.5), ({"upload_wait_s": 0}, 0)):
        rec = Recovery(storage_path=str(tmp_path / "ckpt"), **given)
        rec.after_controller_start(SimpleNamespace(run_config=None))
        assert rec._choice.upload_wait_s == expected


def test_a_restore_that_chooses_for_itself_waits_for_uploads_as_long_as_the_recovery_on_its_storage_says(
    tmp_path, monkeypatch
):
    """A restore with no decision waited its own fixed 120 s for a dead attempt's uploads,
    also under a Recovery watching the same storage: after a failure whose driver-side
    choice timed out the two waits added up to minutes, and ``upload_wait_s=0`` did not
    turn it off. The Recovery now pushes its ``upload_wait_s`` with its decision, to a
    whole group's workers and to a replica mode replacement; a replica restoring inside a
    quorum caps it below its peers' all-reduce timeout."""
    from types import SimpleNamespace

    from ray_goodput import Checkpointer
    from ray_goodput.checkpoint import _checkpointer
    from ray_goodput.runtime._resume import cap_restore_upload_wait, root_key, set_decision

    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "30")  # the hook sets it otherwise
    root = str(tmp_path / "ckpt")
    pushed, restarts = [], []
    group = SimpleNamespace(
        get_workers=lambda: [], execute=lambda fn, *args, restart: (pushed.append(args), restarts.append(restart))
    )
    rec = Recovery(storage_path=root, upload_wait_s=7.5)
    rec.after_controller_start(SimpleNamespace(run_config=None))
    rec.attempt = 1
    rec.after_worker_group_start(group)
    rec.attempt, rec._choice = 2, None  # a later attempt whose choice gave nothing
    rec.after_worker_group_start(group)
    rec.after_replica_group_start(group)  # replica mode: one replica replaced
    assert pushed == [(None, (root_key(root), 7.5))] * 3
    assert restarts == [False, True, True]  # a first start; a later attempt; a replaced replica (storage probe)

    waits = []
    monkeypatch.setattr(_checkpointer, "ray_initialized", lambda: True)  # as under Ray
    monkeypatch.setattr(
        _checkpointer, "wait_for_uploads", lambda root, *, above, timeout_s: waits.append(timeout_s) or {}
    )

    def restore() -> None:
        with Checkpointer(root, uploader="thread") as ckpt:
            assert ckpt.restore({"w": torch.zeros(2)}) is None

    try:
        for told in [pushed[0], (None, (root_key(root), 0.0)), (None, (root_key(str(tmp_path / "other")), 0.0))]:
            set_decision(*told)
            restore()
        set_decision(None)
        restore()
        cap_restore_upload_wait(10.0)
        restore()
    finally:
        set_decision(None)
        cap_restore_upload_wait(None)
    default = _checkpointer.RESTORE_UPLOAD_WAIT_S
    assert waits == [7.5, default, default, 10.0]  # 0 (upload_wait_s=0): no wait at all


def test_a_restore_later_in_the_attempt_chooses_for_itself_not_by_the_drivers_old_decision(tmp_path):
    """The driver's decision is for the attempt's resume. It stayed installed in the worker
    process, so a later restore (a rollback after a loss spike, a new Checkpointer on the
    same root) reloaded the attempt's starting point, or, with "start fresh", loaded
    nothing at all and left the diverged weights in place."""
    from ray_goodput import Checkpointer

    root = str(tmp_path / "root")
    model = torch.nn.Linear(4, 4)
    _resume.set_decision(_resume.ResumeDecision(attempt=2, step=None, root_key=_resume.root_key(root)))
    try:
        with Checkpointer(root, uploader="thread") as ckpt:
            assert ckpt.restore({"model": model}) is None  # the decision: start fresh
            ckpt.save(1, {"model": model})
            ckpt.wait()
            saved = model.weight.detach().clone()
            with torch.no_grad():
                model.weight.add_(1.0)  # diverged
            assert ckpt.restore({"model": model}) == 1  # the rollback finds the step saved since
            assert torch.equal(model.weight, saved)
        with Checkpointer(root, uploader="thread") as again:  # a new one in the same process
            assert again.restore({"model": model}) == 1
    finally:
        _resume.set_decision(None)
    # A process that saved through one Checkpointer and restores through another: a
    # rollback too, not the attempt's resume.
    _resume.set_decision(_resume.ResumeDecision(attempt=3, step=None, root_key=_resume.root_key(root)))
    try:
        with Checkpointer(root, uploader="thread") as saver:
            saver.save(2, {"model": model})
        with Checkpointer(root, uploader="thread") as other:
            assert other.restore({"model": model}) == 2
    finally:
        _resume.set_decision(None)


def test_a_decided_step_pruned_before_the_restore_fails_the_attempt_instead_of_starting_fresh(tmp_path):
    """The driver chose step 20; before the restore read it, a dead attempt's late
    retention (after it committed 30) pruned 20 and everything older. Only a pick lost
    during the load refused to start fresh: this one found nothing at or below 20 and the
    run trained again from step 0. The attempt now fails, and the restart's new decision
    takes what storage holds (30)."""
    from ray_goodput import Checkpointer, CheckpointError

    root = str(tmp_path / "root")
    model = torch.nn.Linear(4, 4)
    with Checkpointer(root, uploader="thread") as ckpt:
        ckpt.save(30, {"model": model})
    _resume.set_decision(_resume.ResumeDecision(attempt=2, step=20, root_key=_resume.root_key(root)))
    try:
        with Checkpointer(root, uploader="thread") as ckpt, pytest.raises(CheckpointError, match="step 20"):
            ckpt.restore({"model": model})
    finally:
        _resume.set_decision(None)
    with Checkpointer(root, uploader="thread") as ckpt:
        assert ckpt.restore({"model": model}) == 30
    # A decided step found damaged, with nothing older, still starts fresh: it is there, and
    # a restart would choose it again (no failure charged for it).
    other = str(tmp_path / "other")
    with Checkpointer(other, uploader="thread") as ckpt:
        ckpt.save(20, {"model": model})
    (shard,) = (tmp_path / "other/checkpoints/step-000000020").glob("__0_*.distcp")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    _resume.set_decision(_resume.ResumeDecision(attempt=2, step=20, root_key=_resume.root_key(other)))
    try:
        with Checkpointer(other, uploader="thread", verify_checksums=True) as ckpt:
            assert ckpt.restore({"model": model}) is None
    finally:
        _resume.set_decision(None)


def test_a_step_saved_again_after_a_rollback_gets_a_save_id_of_its_own(tmp_path):
    """Save ids were made of the generation, a token and the step, unique because "steps
    only grow"; a restore to an older step sets them back, and the step saved again took
    the id of its earlier save: a rank's marker left by that save (its shard durable, the
    save failed on another rank) counted for the new one, committing a mix of both."""
    import json
    import shutil

    from ray_goodput import Checkpointer

    root = str(tmp_path / "root")
    model = torch.nn.Linear(4, 4)
    commit = tmp_path / "root/checkpoints/step-000000006/COMMITTED"
    with Checkpointer(root, uploader="thread", keep_last=5) as ckpt:
        ckpt.save(5, {"model": model})
        ckpt.save(6, {"model": model})
        ckpt.wait()
        first = json.loads(commit.read_text())["nonce"]
        shutil.rmtree(commit.parent)  # step 6 did not commit after all
        assert ckpt.restore({"model": model}) == 5  # the rollback
        ckpt.save(6, {"model": model})
        ckpt.wait()
    assert json.loads(commit.read_text())["nonce"] != first


def test_decision_for_another_root_is_ignored(tmp_path):
    _resume.set_decision(_resume.ResumeDecision(attempt=2, step=7, root_key=_resume.root_key(str(tmp_path / "a"))))
    try:
        assert _resume.resume_decision(str(tmp_path / "a")).step == 7
        assert _resume.resume_decision(str(tmp_path / "b")) is None
    finally:
        _resume.set_decision(None)


def test_a_checkpoint_the_dead_attempt_commits_while_the_new_group_starts_is_the_one_it_resumes_from(tmp_path):
    """The resume step is chosen before the new workers start (here at the start: no poll
    saw the failure); the dead attempt's uploader can still commit a newer checkpoint while
    they start (seconds: processes, imports). The step handed to the workers, just before
    their training function runs, is the newest committed then, and that one is pinned."""
    from types import SimpleNamespace

    from ray_goodput import Checkpointer, list_checkpoints
    from ray_goodput.checkpoint.protocol import _layout
    from ray_goodput.checkpoint.protocol._lineage import checkpoints_location
    from ray_goodput.storage import read_bytes

    root = str(tmp_path / "ckpt")
    model = torch.nn.Linear(8, 8)
    with Checkpointer(root, staging_dir=str(tmp_path / "stage"), uploader="thread", keep_last=1) as ckpt:
        ckpt.save(10, {"model": model})
    rec = Recovery(health_check=None, storage_path=root)
    rec.after_controller_start(SimpleNamespace(run_config=None))
    scaling = ScalingConfig(num_workers=1)
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # attempt 1
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # attempt 2, after a failure

    # The choice starts with the group (no poll saw the failure) and pins step 10.
    def pinned() -> int | None:
        try:
            return json.loads(read_bytes(checkpoints_location(root), _layout.RESUME))["step"]
        except FileNotFoundError:
            return None

    wait_for(lambda: pinned() == 10, timeout_s=60, what="the resume choice begun with the group")
    # The dead attempt's uploader commits step 20 (and prunes to keep_last=1) meanwhile.
    with Checkpointer(root, staging_dir=str(tmp_path / "stage"), uploader="thread", keep_last=1) as ckpt:
        ckpt.save(20, {"model": model})
    handed = []
    group = SimpleNamespace(
        get_workers=lambda: [
            SimpleNamespace(distributed_context=SimpleNamespace(world_rank=0), metadata=SimpleNamespace(node_id="n"))
        ],
        execute=lambda fn, decision, upload_wait, restart: handed.append(decision),
    )
    rec.after_worker_group_start(group)
    assert [d.step for d in handed] == [20]
    assert rec.attempts[-1]["resume_step"] == 20
    rec.after_controller_finish(None)  # the state file is written in the background until here
    assert load_state(root)["attempts"][-1]["resume_step"] == 20
    assert pinned() == 20
    assert [c.step for c in list_checkpoints(root)] == [20]


def test_a_newer_generation_committed_while_the_group_starts_is_taken_though_its_step_is_lower(tmp_path):
    """Newest is the highest (generation, step). The choice found step 130 of an old
    generation (a late commit of a dead attempt); while the new workers started, the
    attempt before committed step 110 of a newer generation. The check for a newer
    checkpoint compared steps alone and kept 130, resuming from an abandoned lineage."""
    from ray_goodput import Checkpointer
    from ray_goodput.driver._resume_choice import ResumeChoice
    from ray_goodput.storage import resolve

    root = str(tmp_path / "ckpt")
    model = torch.nn.Linear(8, 8)
    with Checkpointer(root, staging_dir=str(tmp_path / "a"), uploader="thread") as old:
        old.save(130, {"model": model})
    choice = ResumeChoice(resolve(root), upload_wait_s=0)
    choice.begin(3)
    choice._early[1].join(60)  # chosen: step 130
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread") as newer:
        newer.save(110, {"model": model})  # a newer generation than step 130's
        newer.wait()
        assert newer.generation > 1
    decision = choice.take(3)
    assert decision is not None and decision.step == 110
    choice.close()


def test_the_resume_step_is_chosen_when_the_failure_is_seen_not_when_the_next_group_is_placed(tmp_path):
    """The choice (a listing, a manifest read, the pin) runs in a thread from the poll that
    sees the failure, beside Ray's shutdown and placement; the next start only takes it,
    and the look before the training function starts still finds a newer commit."""
    from types import SimpleNamespace

    from ray_goodput import Checkpointer
    from ray_goodput.checkpoint.protocol import _layout
    from ray_goodput.checkpoint.protocol._lineage import checkpoints_location
    from ray_goodput.storage import read_bytes

    root = str(tmp_path / "ckpt")
    model = torch.nn.Linear(8, 8)
    with Checkpointer(root, staging_dir=str(tmp_path / "stage"), uploader="thread") as ckpt:
        ckpt.save(10, {"model": model})
    rec = Recovery(health_check=None, storage_path=root)
    rec.after_controller_start(SimpleNamespace(run_config=None))
    scaling = ScalingConfig(num_workers=1)
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # attempt 1

    def pinned() -> int | None:
        try:
            return json.loads(read_bytes(checkpoints_location(root), _layout.RESUME))["step"]
        except FileNotFoundError:
            return None

    assert pinned() is None
    rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("a worker died")}))
    wait_for(lambda: pinned() == 10, timeout_s=60, what="the resume choice begun at the failure")
    with Checkpointer(root, staging_dir=str(tmp_path / "stage"), uploader="thread") as ckpt:
        ckpt.save(20, {"model": model})  # committed after the choice, before the next start
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # attempt 2
    assert rec.attempts[-1]["resume_step"] is None  # not waited for here: taken before the function starts
    handed = []
    worker = SimpleNamespace(distributed_context=SimpleNamespace(world_rank=0), metadata=SimpleNamespace(node_id="n"))
    group = SimpleNamespace(
        get_workers=lambda: [worker], execute=lambda fn, decision, upload_wait, restart: handed.append(decision)
    )
    rec.after_worker_group_start(group)
    assert [d.step for d in handed] == [20] and pinned() == 20


def test_placing_the_next_group_does_not_wait_for_the_resume_choice(tmp_path, monkeypatch):
    """The resume step is needed only when the training function starts, seconds after the
    group is placed (new processes, their imports, the process group). The start hook
    waited for the choice begun at the failure (a listing, a manifest read, the pin:
    0.16-0.22 s per restart on the local S3 server), in the placement's critical path."""
    from types import SimpleNamespace

    from ray_goodput import Checkpointer
    from ray_goodput.driver import _resume_choice

    root = str(tmp_path / "ckpt")
    with Checkpointer(root, staging_dir=str(tmp_path / "stage"), uploader="thread") as ckpt:
        ckpt.save(10, {"model": torch.nn.Linear(8, 8)})
    gate = threading.Event()
    real_newest = _resume_choice.newest_valid

    def held_newest(where):  # storage that answers only when the test says so
        assert gate.wait(60), "the test never released the resume choice"
        return real_newest(where)

    monkeypatch.setattr(_resume_choice, "newest_valid", held_newest)
    rec = Recovery(health_check=None, storage_path=root)
    rec.after_controller_start(SimpleNamespace(run_config=None))
    scaling = ScalingConfig(num_workers=1)
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # attempt 1
    rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("a worker died")}))
    placing = threading.Thread(
        target=rec.on_controller_start_worker_group, kwargs={"scaling_config": scaling, "num_workers": 1}
    )
    placing.start()
    placing.join(30)
    try:
        assert not placing.is_alive(), "the start of the next group waited for the resume choice"
    finally:
        gate.set()
    handed = []
    worker = SimpleNamespace(distributed_context=SimpleNamespace(world_rank=0), metadata=SimpleNamespace(node_id="n"))
    rec.after_worker_group_start(
        SimpleNamespace(
            get_workers=lambda: [worker], execute=lambda fn, decision, upload_wait, restart: handed.append(decision)
        )
    )
    assert [d.step for d in handed] == [10] and rec.attempts[-1]["resume_step"] == 10
    rec.after_controller_finish(None)
    assert load_state(root)["attempts"][-1]["resume_step"] == 10


def test_a_restarts_hooks_do_not_wait_for_storage_to_write_the_recovery_record(tmp_path, monkeypatch):
    """The record (``recovery/state.json``, for people and ``ray-goodput status``) was
    written inside the start hooks: one PUT in a restart's critical path, 0.2 s on the
    local S3 server while the dead attempt's uploads still ran. It is written in the
    background; the controller's end waits for the newest one."""
    from types import SimpleNamespace

    from ray_goodput.driver import _record

    gate = threading.Event()
    writes = []
    real_write = _record.write_bytes

    def held_write(root, name, data):  # storage that answers only when the test says so
        assert gate.wait(60), "the test never released the write"
        writes.append(json.loads(data))
        real_write(root, name, data)

    root = str(tmp_path / "ckpt")
    rec = Recovery(health_check=None, storage_path=root)
    rec.after_controller_start(SimpleNamespace(run_config=None))
    monkeypatch.setattr(_record, "write_bytes", held_write)
    try:
        scaling = ScalingConfig(num_workers=1)
        placing = threading.Thread(
            target=rec.on_controller_start_worker_group, kwargs={"scaling_config": scaling, "num_workers": 1}
        )
        placing.start()
        placing.join(30)
        assert not placing.is_alive(), "the start hook waited for storage to write the recovery record"
    finally:
        gate.set()
        rec.after_controller_finish(None)
    assert writes and writes[-1]["attempts"][-1]["attempt"] == 1
    assert load_state(root)["attempts"][-1]["attempt"] == 1


def test_a_choice_begun_for_an_attempt_whose_group_never_started_is_not_handed_to_the_next(tmp_path):
    """Ray can fail a group's start before its training function (a start timeout, too few
    resources): the choice begun for that attempt was taken by the next one, with the old
    attempt number (the generation its pin was for)."""
    from types import SimpleNamespace

    from ray_goodput import Checkpointer

    root = str(tmp_path / "ckpt")
    with Checkpointer(root, staging_dir=str(tmp_path / "stage"), uploader="thread") as ckpt:
        ckpt.save(10, {"model": torch.nn.Linear(8, 8)})
    rec = Recovery(health_check=None, storage_path=root)
    rec.after_controller_start(SimpleNamespace(run_config=None))
    scaling = ScalingConfig(num_workers=1)
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # attempt 1
    rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("a worker died")}))
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # attempt 2: its start fails
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # attempt 3
    handed = []
    worker = SimpleNamespace(distributed_context=SimpleNamespace(world_rank=0), metadata=SimpleNamespace(node_id="n"))
    rec.after_worker_group_start(
        SimpleNamespace(
            get_workers=lambda: [worker], execute=lambda fn, decision, upload_wait, restart: handed.append(decision)
        )
    )
    assert [(d.attempt, d.step) for d in handed] == [(3, 10)]
    rec.after_controller_finish(None)


def test_the_runs_end_stops_a_resume_choice_waiting_for_uploads_instead_of_leaving_it_in_ray_get(ray_local, tmp_path):
    """A resume choice begun at a failure waits (up to upload_wait_s) for the node
    uploaders' answers about saves still in flight. A run that ended meanwhile left that
    thread inside ray.get while Ray shut down under it: it died with SystemExit in the
    suite's warnings, and once the whole pytest process died with a segfault in CI. The
    run's end now stops the wait and joins the thread. The uploader is a stand-in actor
    under the uploader's name, whose answer takes the whole bound."""
    from ray_goodput.checkpoint.uploader._actor import KIND
    from ray_goodput.driver._resume_choice import ResumeChoice
    from ray_goodput.runtime import _services
    from ray_goodput.storage import resolve

    @ray.remote(num_cpus=0)
    class _SaveInFlight:
        def wait_uploads(self, key: str, above: int | None, timeout_s: float) -> list[int]:
            time.sleep(timeout_s)
            return [7]

    name = _services.actor_name(KIND, f"stand-in-{os.getpid()}")
    stand_in = _SaveInFlight.options(name=name, namespace=_services.NAMESPACE).remote()
    try:
        ray.get(stand_in.__ray_ready__.remote(), timeout=60)
        choice = ResumeChoice(resolve(str(tmp_path)), upload_wait_s=60.0)
        choice.begin(2)
        thread = choice._early[1]
        time.sleep(1.0)  # listed the (empty) storage; now waiting for the stand-in's answer
        assert thread.is_alive()
        began = time.monotonic()
        choice.close()
        assert not thread.is_alive() and time.monotonic() - began < 5.0
    finally:
        ray.kill(stand_in)
