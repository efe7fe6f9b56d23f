"""Driver-side Recovery's policy, without a cluster: node isolation, errors that no retry
can fix, its arguments, the trainer's callbacks, the recovery record, the GPU check, and
what a replica's failure or a preemption charges."""

from __future__ import annotations

import os

import pytest
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from ray_goodput.driver import _gpu_check
from ray_goodput.driver._placement import NodeLedger, workers_that_fit
from ray_goodput.driver._record import load_state
from ray_goodput.driver._recovery import Recovery, futile
from ray_goodput.driver._trainer import TorchTrainer
from ray_goodput.errors import ConfigError, StateMismatchError


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


def test_a_replica_that_found_no_peer_charges_no_node(tmp_path):
    """A replica raises ReplicaJoinError when no peer came to its quorum in time, and
    ReplicaStepError when its steps stopped committing: both say its peers failed, not its
    node. Each was charged to the node the replica ran on, and two such failures isolated
    a healthy node. The failure that killed the peer is still charged to the peer's node."""
    from types import SimpleNamespace

    from ray.exceptions import RayTaskError

    from ray_goodput.replica._replica import ReplicaJoinError, ReplicaStepError

    rec = Recovery(health_check=None, storage_path=str(tmp_path), max_failures_per_node=2)
    rec.checks_at_failure = False
    rec.after_controller_start(SimpleNamespace(run_config=None))
    rec._rank_nodes = {0: "node-A", 1: "node-B"}
    replaced = SimpleNamespace(
        get_workers=lambda: [
            SimpleNamespace(
                distributed_context=SimpleNamespace(world_rank=1), metadata=SimpleNamespace(node_id="node-B")
            )
        ],
        execute=lambda fn, *args, restart: None,
    )
    wrapped = RayTaskError("train_fn", "Traceback ...", ReplicaStepError("steps stopped committing"))
    for error in (ReplicaJoinError("found 1 of 2 replicas"), wrapped, ReplicaJoinError("again")):
        rec.after_worker_group_poll_status(SimpleNamespace(errors={1: error}))
        rec.after_replica_group_start(replaced)
    rec.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("worker died")}))
    assert rec.ledger.failures == {"node-A": 1} and rec.isolated_nodes == []
    try:  # the node's own error while it unwound one: charged
        try:
            raise ReplicaJoinError("found 1 of 2 replicas")
        except ReplicaJoinError:
            raise OSError("the staging disk failed") from None
    except OSError as exc:
        own = exc
    assert isinstance(own.__context__, ReplicaJoinError)
    rec.after_worker_group_poll_status(SimpleNamespace(errors={1: own}))
    rec.after_controller_finish(None)
    assert rec.ledger.failures == {"node-A": 1, "node-B": 1}
