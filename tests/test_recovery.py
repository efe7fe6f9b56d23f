"""Driver-side Recovery on a real multi-node Ray cluster, plus its pure parts.

Cluster (module-scoped): a head with no CPUs (driver and Train controller only), node X
with 2 CPUs, nodes Y and Z with 1 CPU each. Two 1-CPU workers with Ray Train's default PACK
placement land both on X, the only node that holds them together: X is where Ray's default
placement puts them, so X is the node the tests make unhealthy.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_goodput.driver import _gpu_check
from ray_goodput.driver._placement import NodeLedger, workers_that_fit
from ray_goodput.driver._record import load_state
from ray_goodput.driver._recovery import Recovery, futile
from ray_goodput.driver._trainer import TorchTrainer
from ray_goodput.errors import ConfigError, StateMismatchError
from ray_goodput.runtime import _resume
from ray_goodput.testing import publish_file, wait_for
from tests._node_checks import FailsOn

# ---- pure parts ---------------------------------------------------------------------------


def test_node_is_isolated_exactly_at_max_failures():
    ledger = NodeLedger(max_failures_per_node=2)
    assert ledger.record("a") is False and ledger.isolated == []
    assert ledger.record("b") is False
    assert ledger.record("a") is True and ledger.isolated == ["a"]
    assert ledger.record("a") is False and ledger.isolated == ["a"]  # isolated once


def test_futile_error_is_found_by_type_inside_ray_wrappers_not_by_message():
    inner = StateMismatchError("model has 3 layers, checkpoint 4")
    wrapped = ControllerError(WorkerGroupError("x", {0: RuntimeError("peer gone"), 1: inner}))
    assert futile(wrapped) is inner
    assert futile(WorkerGroupError("x", {0: RuntimeError("StateMismatchError: looks alike")})) is None
    chained = RuntimeError("restore failed")
    chained.__cause__ = ConfigError("bad keep_last")
    assert isinstance(futile(chained), ConfigError)


def test_worker_capacity_counts_whole_workers_per_node():
    assert workers_that_fit({"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0}) == 2
    assert workers_that_fit({"CPU": 8.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}) == 1
    assert workers_that_fit({"CPU": 8.0}, {"GPU": 1.0}) == 0


def test_bad_recovery_arguments_name_the_fix():
    with pytest.raises(ConfigError, match="max_failures_per_node"):
        Recovery(max_failures_per_node=0)
    with pytest.raises(ConfigError, match="health_check"):
        Recovery(health_check="cpu")
    for bad in (-1, float("inf"), float("nan"), "5", True):  # inf made the choice's join unbounded
        with pytest.raises(ConfigError, match="upload_wait_s"):
            Recovery(upload_wait_s=bad)
    with pytest.raises(ConfigError, match="pass it once"):
        TorchTrainer(lambda: None, callbacks=[Recovery()], recovery=Recovery())


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


def test_a_restart_bounds_the_old_process_groups_teardown_unless_the_user_set_it(monkeypatch):
    from ray_goodput.driver._recovery import TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S as VAR
    from ray_goodput.driver._recovery import _bound_process_group_shutdown

    monkeypatch.delenv(VAR, raising=False)
    _bound_process_group_shutdown(Recovery().pg_shutdown_timeout_s)
    assert os.environ[VAR] == "5"  # Ray's default is 30 s per restart
    monkeypatch.setenv(VAR, "17")
    _bound_process_group_shutdown(5.0)
    assert os.environ[VAR] == "17"
    monkeypatch.delenv(VAR)
    _bound_process_group_shutdown(None)
    assert VAR not in os.environ
    with pytest.raises(ConfigError, match="pg_shutdown_timeout_s"):
        Recovery(pg_shutdown_timeout_s=0.5)


def test_trainer_merges_callbacks_into_run_config_and_recovery_none_turns_it_off():
    user = Recovery(max_failures_per_node=3)
    t = TorchTrainer(lambda: None, run_config=RunConfig(name="m", callbacks=[user]))
    assert t.run_config.callbacks[0] is user and t.recovery is user and t.run_config.name == "m"
    # and the node services that start each node's uploader before the training function
    assert [type(c).__name__ for c in t.run_config.callbacks[1:]] == ["NodeServices"]
    assert t.run_config.callbacks[1].runtime_env is None
    # which give the uploaders the workers' runtime env (a worker-created one inherited it)
    env = {"env_vars": {"AWS_PROFILE": "training"}}
    t = TorchTrainer(lambda: None, run_config=RunConfig(worker_runtime_env=env))
    assert next(c for c in t.run_config.callbacks if type(c).__name__ == "NodeServices").runtime_env == env
    t = TorchTrainer(lambda: None, recovery=None)
    assert not any(isinstance(c, Recovery) for c in t.run_config.callbacks) and t.recovery is None
    assert isinstance(TorchTrainer(lambda: None).recovery, Recovery)
    # a GoodputCallback gets its controller hooks once, whether or not the user added them
    from ray_goodput import GoodputCallback
    from ray_goodput.driver._callback import GoodputControllerHooks

    goodput = GoodputCallback()
    for given in ([goodput], [goodput, goodput.controller_callback()]):
        t = TorchTrainer(lambda: None, callbacks=given)
        hooks = [c for c in t.run_config.callbacks if isinstance(c, GoodputControllerHooks)]
        assert len(hooks) == 1 and hooks[0].goodput is goodput


@pytest.mark.parametrize("record", ["{not json", '{"attempts": []}'])
def test_an_unreadable_recovery_record_after_fit_is_logged_not_raised_over_the_runs_result(tmp_path, record, caplog):
    """fit() reads the run's recovery record back in its ``finally``. A record that was not
    JSON, or missed a field, raised there (ValueError, KeyError), replacing fit()'s result
    or the run's own error with one about the record."""
    from ray_goodput.driver._record import STATE_FILE

    t = TorchTrainer(lambda: None, recovery=Recovery(storage_path=str(tmp_path)))
    path = tmp_path / STATE_FILE
    path.parent.mkdir(parents=True)
    path.write_text(record)
    t._refresh_recovery()
    assert "could not read the recovery record" in caplog.text


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


def test_gpu_check_comparison_catches_nan_inf_and_wrong_results():
    a = torch.randn(8, 8)
    assert _gpu_check.compare_results(a.clone(), a) is None
    bad = a.clone()
    bad[0, 0] = float("nan")
    assert "NaN" in _gpu_check.compare_results(bad, a)
    bad[0, 0] = float("inf")
    assert "Inf" in _gpu_check.compare_results(bad, a)
    assert "differs" in _gpu_check.compare_results(a + 1.0, a)


def test_gpu_check_device_path_and_no_gpu_pass_on_cpu():
    assert _gpu_check.check_device(torch.device("cpu"), alloc_gib=0.01) is None
    assert not torch.cuda.is_available()  # this machine: the check passes with a note
    assert _gpu_check.gpu_check() is True


# ---- a real cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    x = c.add_node(num_cpus=2)
    y = c.add_node(num_cpus=1)
    z = c.add_node(num_cpus=1)
    ray.init(
        address=c.address, log_to_driver=False, runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}}
    )
    c.wait_for_nodes()
    yield {"x": x.node_id, "y": y.node_id, "z": z.node_id}
    ray.shutdown()
    c.shutdown()


def _record(out: str, **fields) -> dict:
    decision = _resume.resume_decision()
    rec = {
        "attempt": decision.attempt if decision else 1,
        "step": decision.step if decision else None,
        "rank": ray.train.get_context().get_world_rank(),
        "node": ray.get_runtime_context().get_node_id(),
        "t": time.time(),
        **fields,
    }
    publish_file(Path(out, f"rec-{os.getpid()}.json"), json.dumps(rec))  # whole, or not there
    return rec


def _records(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("rec-*.json")), key=lambda r: (r["attempt"], r["rank"]))


def _loop(config: dict) -> None:
    _record(config["out"])
    if config.get("futile"):
        raise StateMismatchError("the model has 3 layers, the checkpoint 4: pass the right model")


def _dies_on_bad_node_loop(config: dict) -> None:
    """Attempt 1 saves steps 1-3 (committed) and every attempt on the bad node loses a
    worker to SIGKILL: a node whose workers always die."""
    from ray_goodput import Checkpointer
    from ray_goodput.testing import kill_self

    model = torch.nn.Linear(4, 4)
    state = {"model": model}
    with Checkpointer(keep_last=5) as ckpt:
        restored = ckpt.restore(state)
        rec = _record(config["out"], restored=restored)
        if restored is None:
            for step in (1, 2, 3):
                ckpt.save(step, state)
            ckpt.wait()
        if rec["node"] == config["bad"]:
            if rec["rank"] == 1:  # once rank 0 recorded this attempt (the kill tears it down)
                wait_for(
                    lambda: any(
                        r["attempt"] == rec["attempt"] and r["rank"] == 0 for r in _records(Path(config["out"]))
                    ),
                    timeout_s=60,
                    what="rank 0's record of this attempt",
                )
                kill_self()
            time.sleep(60)  # bounded: the controller tears this rank down once rank 1 is gone


def _fit(tmp_path: Path, name: str, recovery: Recovery | None, max_failures: int, loop=_loop, **config):
    out = tmp_path / name
    out.mkdir()
    trainer = TorchTrainer(
        loop,
        train_loop_config={"out": str(out), **config},
        recovery=recovery,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path / "runs"),
            failure_config=FailureConfig(max_failures=max_failures, controller_failure_limit=3),
        ),
    )
    return trainer, out


@ray.remote(num_cpus=1)
class _Blocker:
    """Holds a CPU of Y or Z so that attempts go to X for as long as X is allowed."""

    def ping(self) -> int:
        return 1


def _unblock_when_isolated(root: Path, node: str, blockers: list, seen: list, fitted: threading.Event) -> None:
    while not fitted.is_set():  # no deadline of its own: attempts on X take longer under load
        state = load_state(str(root))
        if state and node in state["isolated_nodes"]:
            seen.append(state)
            for b in blockers:
                ray.kill(b)
            return
        time.sleep(0.2)


@pytest.mark.cluster
@pytest.mark.slow
def test_node_whose_workers_always_die_is_isolated_and_every_rank_restores_the_step_the_driver_chose(cluster, tmp_path):
    """Two behaviours, one run (each restart costs ~10 s here): X, where a worker is
    SIGKILLed in every attempt, is isolated after two and the run completes on Y and Z; and
    after each SIGKILL every rank restores the step the driver chose (3, committed by
    attempt 1), on X and then on other nodes."""
    # Y and Z are busy until X is isolated: Ray's placement has no choice but X until then,
    # whatever the timing of resource release between attempts.
    blockers = [
        _Blocker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(cluster[n], soft=False)).remote()
        for n in ("y", "z")
    ]
    ray.get([b.ping.remote() for b in blockers], timeout=60)
    seen: list = []
    fitted = threading.Event()
    watcher = threading.Thread(
        target=_unblock_when_isolated,
        daemon=True,
        args=(tmp_path / "runs" / "isolate", cluster["x"], blockers, seen, fitted),
    )
    watcher.start()
    trainer, out = _fit(
        tmp_path, "isolate", Recovery(max_failures_per_node=2), 4, loop=_dies_on_bad_node_loop, bad=cluster["x"]
    )
    try:
        trainer.fit()
    finally:
        fitted.set()
        watcher.join(timeout=30)
    assert seen, "node X was never isolated"
    recs = _records(out)
    on_x = sorted({r["attempt"] for r in recs if r["node"] == cluster["x"]})
    last = max(r["attempt"] for r in recs)
    assert on_x == [1, 2], recs  # Ray's placement picked X until X was isolated
    assert {r["node"] for r in recs if r["attempt"] == last} == {cluster["y"], cluster["z"]}
    assert trainer.recovery.isolated_nodes == [cluster["x"]]
    state = load_state(str(tmp_path / "runs" / "isolate"))
    assert state["attempts"][-1]["excluded_nodes"] == [cluster["x"]]
    # After each SIGKILL, every rank restored the step the driver chose.
    assert all(r["restored"] is None and r["step"] is None for r in recs if r["attempt"] == 1), recs
    for attempt in range(2, last + 1):
        ranks = [r for r in recs if r["attempt"] == attempt]
        assert [r["rank"] for r in ranks] == [0, 1], recs
        assert all(r["step"] == 3 and r["restored"] == 3 for r in ranks), ranks
        assert state["attempts"][attempt - 1]["resume_step"] == 3, state["attempts"]


@pytest.mark.cluster
@pytest.mark.slow
def test_failing_health_check_keeps_workers_off_x_and_a_not_retryable_error_there_ends_the_run(cluster, tmp_path):
    """Two behaviours, one run (each fit costs ~11 s here): the health check keeps the
    workers off X, the node Ray's placement would pick; the run then fails on Y and Z with
    a StateMismatchError, which no retry fixes, so it runs one attempt despite max_failures=5."""
    checks = tmp_path / "checks"
    checks.mkdir()
    # A generous timeout: on a loaded machine the check task itself takes seconds to start, and
    # a timed-out check would exclude X for the wrong reason (the assertions below tell).
    recovery = Recovery(health_check=FailsOn(cluster["x"], str(checks)), health_check_timeout_s=180)
    trainer, out = _fit(tmp_path, "health", recovery, 5, futile=True)
    with pytest.raises(ControllerError) as info:
        trainer.fit()
    recs = _records(out)
    assert {r["node"] for r in recs} == {cluster["y"], cluster["z"]}, recs
    assert any(p.name.startswith(f"check-{cluster['x']}") for p in checks.iterdir())  # it did run there
    assert list(load_state(str(tmp_path / "runs" / "health"))["attempts"][0]["unhealthy"]) == [cluster["x"]]
    # not retryable: one attempt, and the error the user sees is the cause, by type
    assert isinstance(info.value.controller_failure, StateMismatchError)
    assert {r["attempt"] for r in recs} == {1}
    assert trainer.recovery.stopped["error"].startswith("StateMismatchError")


@pytest.mark.cluster
def test_node_checks_start_when_the_failure_is_seen_and_the_next_start_uses_their_verdicts(
    cluster, tmp_path, monkeypatch
):
    """The controller's hooks called directly on a real cluster (the checks are real Ray
    tasks on real nodes): the poll that sees a failure starts the checks, so they run
    beside Ray's shutdown of the old group; the next start reads their verdicts instead of
    starting a second round."""
    from types import SimpleNamespace

    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "30")  # the hook sets it otherwise
    checks = tmp_path / "checks"
    checks.mkdir()
    rec = Recovery(health_check=FailsOn(cluster["x"], str(checks)), storage_path=str(tmp_path / "ckpt"))
    rec.after_controller_start(SimpleNamespace(run_config=None))
    scaling = ScalingConfig(num_workers=2)
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=2)
    per_round = len(list(checks.iterdir()))
    assert per_round == 3  # X, Y, Z: the head has no CPU for a worker
    rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("a worker died")}))
    rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("a worker died")}))  # once
    wait_for(lambda: len(list(checks.iterdir())) == 2 * per_round, timeout_s=60, what="the checks of the failure")
    selector = rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=2)
    assert len(list(checks.iterdir())) == 2 * per_round  # no third round
    assert list(rec.attempts[1]["unhealthy"]) == [cluster["x"]]
    assert cluster["x"] in selector["ray.io/node-id"]


@pytest.mark.cluster
def test_the_last_nodes_that_can_hold_the_workers_are_never_isolated(cluster, tmp_path, monkeypatch):
    """A worker of 2 CPUs fits on X alone: isolating X after its failures would leave no
    node for it, and Ray would wait for capacity for ever (its placement timeout is retried
    without limit). X stays, and Ray's max_failures bounds the retries; a 1-CPU worker's
    failing node is isolated as before, Y and Z hold it."""
    from types import SimpleNamespace

    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "30")  # the hook sets it otherwise
    for cpus, isolated in ((2, []), (1, [cluster["x"]])):
        rec = Recovery(max_failures_per_node=1, storage_path=str(tmp_path / f"ckpt{cpus}"))
        rec.after_controller_start(SimpleNamespace(run_config=None))
        scaling = ScalingConfig(num_workers=1, resources_per_worker={"CPU": cpus})
        assert rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1) is None
        rec._rank_nodes = {0: cluster["x"]}  # where after_worker_group_start found rank 0
        rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("a bug")}))
        assert rec.isolated_nodes == isolated, cpus
        selector = rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)
        assert (selector is None) == (not isolated), selector
        assert rec.ledger.failures[cluster["x"]] == 1


@pytest.mark.cluster
def test_nodes_failing_their_check_at_every_start_with_no_room_left_end_the_run_naming_them(
    cluster, tmp_path, monkeypatch
):
    """Only X holds a 2-CPU worker and X fails its check at every start: Ray would wait for
    capacity and retry that start for ever. At max_failures_per_node starts in a row the
    start raises, naming the node and why it failed; Ray ends the run with it."""
    from types import SimpleNamespace

    from ray_goodput.errors import NoHealthyNodesError

    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "30")  # the hook sets it otherwise
    checks = tmp_path / "checks"
    checks.mkdir()
    rec = Recovery(
        health_check=FailsOn(cluster["x"], str(checks)), max_failures_per_node=2, storage_path=str(tmp_path / "c")
    )
    rec.after_controller_start(SimpleNamespace(run_config=None))
    scaling = ScalingConfig(num_workers=1, resources_per_worker={"CPU": 2})
    rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)  # short once: waits
    with pytest.raises(NoHealthyNodesError, match=cluster["x"]) as info:
        rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=1)
    assert "returned False" in str(info.value) and "max_failures_per_node" in str(info.value)
    assert rec.isolated_nodes == []  # the only node that holds the worker: never isolated


@pytest.mark.cluster
def test_a_node_that_failed_its_check_while_the_failed_group_still_ran_there_is_checked_again(
    cluster, tmp_path, monkeypatch
):
    """The checks start at the poll that sees the failure, before Ray shut the old group
    down: on X, where its workers still ran, a GPU check's 2 GiB allocation meets their
    memory and fails. That verdict kept a healthy X out and counted toward its isolation;
    the start now checks X again."""
    from types import SimpleNamespace

    from tests._node_checks import FailsWhileBusy

    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "30")  # the hook sets it otherwise
    checks, busy = tmp_path / "checks", tmp_path / "busy"
    checks.mkdir()
    rec = Recovery(health_check=FailsWhileBusy(cluster["x"], str(busy), str(checks)), storage_path=str(tmp_path / "c"))
    rec.after_controller_start(SimpleNamespace(run_config=None))
    scaling = ScalingConfig(num_workers=2)
    assert rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=2) is None
    rec._rank_nodes = {0: cluster["x"], 1: cluster["x"]}  # where the group ran
    busy.touch()  # its workers hold X until Ray shuts the group down
    rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("a worker died")}))
    wait_for(lambda: len(list(checks.iterdir())) == 6, timeout_s=60, what="the checks of the failure")
    busy.unlink()  # the old group is gone
    assert rec.on_controller_start_worker_group(scaling_config=scaling, num_workers=2) is None
    assert rec.attempts[1]["unhealthy"] == {}
    assert rec.ledger.failures == {cluster["x"]: 1}  # its worker's failure, not its check's
    assert len(list(checks.iterdir())) == 7  # X once more; Y and Z kept their verdicts
    rec.after_controller_finish(None)  # as the controller ends: its resume choice is stopped


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


def test_replica_mode_does_not_start_node_checks_at_a_replicas_failure(tmp_path):
    from types import SimpleNamespace

    from ray_goodput.replica import ReplicaGroups

    recovery = Recovery(health_check=lambda: True, storage_path=str(tmp_path))
    trainer = TorchTrainer(
        lambda: None,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="r"),
        recovery=recovery,
        fault_tolerance=ReplicaGroups(),
    )
    assert trainer.recovery.checks_at_failure is False
    trainer.recovery._scaling = ScalingConfig(num_workers=2)
    trainer.recovery.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("replica died")}))
    assert trainer.recovery._early_checks is None  # no task started on any node


def _preempted_error():
    from ray.core.generated.common_pb2 import ActorDiedErrorContext, NodeDeathInfo
    from ray.exceptions import ActorDiedError

    drained = NodeDeathInfo(reason=NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED)  # as Ray builds it
    preempted = ActorDiedError(ActorDiedErrorContext(actor_id=b"\0" * 16, node_death_info=drained))
    assert preempted.preempted
    return preempted


def test_a_preemption_polled_many_times_is_one_failure_and_charges_no_surviving_node(tmp_path):
    """While Ray waits out a preemption (PreemptingState) it polls every 2 s and the same
    errors come back at each poll before its one decision: each poll was charged to
    max_preemption_failures, and the survivors' collateral errors (a collective aborted)
    counted against their nodes, which two preemptions isolated while the spot node was not."""
    from types import SimpleNamespace

    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    rec = Recovery(health_check=None, storage_path=str(tmp_path), max_failures_per_node=2)
    rec.checks_at_failure = False
    rec.after_controller_start(SimpleNamespace(run_config=None))
    preempted = _preempted_error()
    for _ in range(2):  # two preemptions of node A; B hosts the survivor
        rec.on_controller_start_worker_group(scaling_config=ScalingConfig(num_workers=2), num_workers=2)
        rec._rank_nodes = {0: "node-B", 1: "node-A"}
        for _ in range(5):  # the polls of one PreemptingState, then Ray's one decision
            rec.after_worker_group_poll_status(
                SimpleNamespace(errors={1: preempted, 0: RuntimeError("collective aborted")})
            )
        rec.before_controller_execute_failure_decision(FailureDecision.RETRY)
    rec.after_controller_finish(None)
    assert load_state(str(tmp_path))["failures_charged"] == {"max_failures": 0, "max_preemption_failures": 2}
    assert rec.ledger.failures == {} and rec.isolated_nodes == []


def test_a_preemption_that_ray_decides_on_with_no_error_in_any_poll_is_still_charged(tmp_path):
    """Ray decides on a PreemptionError when the grace period ends, also when no poll showed
    an error (the draining node's worker still ran): nothing was charged."""
    from types import SimpleNamespace

    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    rec = Recovery(health_check=None, storage_path=str(tmp_path))
    rec.after_controller_start(SimpleNamespace(run_config=None))
    rec.on_controller_start_worker_group(scaling_config=ScalingConfig(num_workers=2), num_workers=2)
    draining = SimpleNamespace(errors={}, get_preemption_info=lambda: "node-A drains")
    for _ in range(3):
        rec.after_worker_group_poll_status(draining)
    rec.before_controller_execute_failure_decision(FailureDecision.RETRY)
    # In the next attempt a node is again being preempted, and a worker on another node
    # fails with no preempted worker among the errors: Ray fails fast on that worker group
    # error, charged to max_failures. Its node is not charged: during a reclaim a worker's
    # own failure cannot be told from a side effect of it (a peer's collective broke).
    rec.on_controller_start_worker_group(scaling_config=ScalingConfig(num_workers=2), num_workers=2)
    rec._rank_nodes = {0: "node-A", 1: "node-B"}
    rec.after_worker_group_poll_status(draining)
    failing = SimpleNamespace(errors={1: RuntimeError("a bug")}, get_preemption_info=lambda: "node-A drains")
    failing.has_preempted_worker = lambda: False
    rec.after_worker_group_poll_status(failing)
    rec.before_controller_execute_failure_decision(FailureDecision.RETRY)
    rec.after_controller_finish(None)
    assert load_state(str(tmp_path))["failures_charged"] == {"max_failures": 1, "max_preemption_failures": 1}
    assert rec.ledger.failures == {}


def test_the_record_counts_each_failure_against_the_ray_budget_it_uses(tmp_path):
    """One of Ray's failure decisions is one failure: charged to max_failures, or to
    max_preemption_failures when a worker was preempted; a re-run of fit() goes on from it."""
    from types import SimpleNamespace

    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    rec = Recovery(health_check=None, storage_path=str(tmp_path))
    rec.after_controller_start(SimpleNamespace(run_config=None))
    rec.on_controller_start_worker_group(scaling_config=ScalingConfig(num_workers=2), num_workers=2)
    rec.after_worker_group_poll_status(SimpleNamespace(errors={}))
    rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("a bug"), 1: RuntimeError("gone")}))
    rec.before_controller_execute_failure_decision(FailureDecision.RETRY)
    rec.on_controller_start_worker_group(scaling_config=ScalingConfig(num_workers=2), num_workers=2)
    preempted = _preempted_error()
    rec.after_worker_group_poll_status(SimpleNamespace(errors={1: preempted, 0: RuntimeError("collateral")}))
    rec.before_controller_execute_failure_decision(FailureDecision.RETRY)
    rec.after_controller_finish(None)
    assert load_state(str(tmp_path))["failures_charged"] == {"max_failures": 1, "max_preemption_failures": 1}
