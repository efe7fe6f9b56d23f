"""Replica mode's settings, the trainer arguments it sets, and what the driver tells replica
groups (its hooks get stand-ins of Ray's worker-group objects; the lighthouse test starts
real actors on the shared local Ray)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import ray.train
from ray.train.v2.torch.torchft_config import TorchftConfig

from ray_goodput.driver import _replicas
from ray_goodput.driver._replicas import EarlyLighthouseConfig, ReplicaSupport, replica_kwargs
from ray_goodput.driver._trainer import replacement_raced, rerun_failure_config
from ray_goodput.errors import ConfigError
from ray_goodput.replica import ReplicaGroups
from ray_goodput.runtime import WorkerContext, world_of_one
from ray_goodput.runtime._join import set_join, worker_join
from ray_goodput.testing import wait_for


def test_replica_settings_are_validated_with_the_setting_named():
    with pytest.raises(ConfigError, match="min_replicas"):
        ReplicaGroups(min_replicas=0)
    with pytest.raises(ConfigError, match="max_failures"):
        ReplicaGroups(max_failures=-1)
    with pytest.raises(ConfigError, match="timeout_s=2.0.* must exceed heartbeat_timeout_s=5"):
        ReplicaGroups(heartbeat_timeout_s=5.0, timeout_s=2.0)
    with pytest.raises(ConfigError, match="start_timeout_s=10.0.* at least timeout_s=30"):
        ReplicaGroups(start_timeout_s=10.0)
    with pytest.raises(ConfigError, match="join_timeout_s"):
        ReplicaGroups(join_timeout_s=0)
    with pytest.raises(ConfigError, match="join_timeout_s"):
        ReplicaGroups(join_timeout_s=60.0)  # past timeout_s: a quorum would time out first
    assert ReplicaGroups(min_replicas=2, heartbeat_timeout_s=0.5).lighthouse_kwargs() == {
        "min_replicas": 2,
        "heartbeat_timeout_ms": 500,
        "join_timeout_ms": 500,
    }
    assert ReplicaGroups(join_timeout_s=5.0).lighthouse_kwargs()["join_timeout_ms"] == 5000


def test_replica_mode_sets_torchfts_backend_and_a_failure_budget_for_replacements():
    run_config, kwargs = replica_kwargs(ReplicaGroups(max_failures=7), ray.train.RunConfig(), {})
    assert isinstance(kwargs["torch_config"], EarlyLighthouseConfig) and kwargs["torch_config"].backend == "gloo"
    assert isinstance(kwargs["torch_config"], TorchftConfig)  # Ray's replica-group path
    assert kwargs["torch_config"].lighthouse_kwargs["min_replicas"] == 1
    assert run_config.failure_config.max_failures == 7  # Ray's default 0 would end the run at the first failure
    mine = ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_failures=3))
    assert replica_kwargs(ReplicaGroups(), mine, {})[0].failure_config.max_failures == 3  # the user's stands


def test_replica_mode_refuses_what_it_cannot_run_and_names_the_fix():
    rc = ray.train.RunConfig()
    with pytest.raises(ConfigError, match="datasets="):
        replica_kwargs(ReplicaGroups(), rc, {"datasets": {"train": object()}})
    with pytest.raises(ConfigError, match="use_gpu=False"):
        replica_kwargs(ReplicaGroups(), rc, {"scaling_config": ray.train.ScalingConfig(num_workers=2, use_gpu=True)})
    with pytest.raises(ConfigError, match="torch_config"):
        replica_kwargs(ReplicaGroups(), rc, {"torch_config": ray.train.torch.TorchConfig()})
    with pytest.raises(ConfigError, match="ReplicaGroups or None"):
        replica_kwargs("replicas", rc, {})


def test_without_torchft_replica_mode_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ConfigError, match=r'pip install "ray-goodput\[ft\]"'):
        replica_kwargs(ReplicaGroups(), ray.train.RunConfig(), {})


def test_the_durable_saver_sees_a_world_of_one_outside_ray_trains_barrier():
    """Replica 0's Checkpointer must not call ray.train.report: its barrier waits for every
    replica, and one being replaced is blocked in a quorum with the one that waits."""
    outside = WorkerContext.detect()
    with world_of_one():
        inside = WorkerContext.detect()
    assert (inside.rank, inside.world_size, inside.in_ray_train) == (0, 1, False)
    assert WorkerContext.detect() == outside


class _Group:
    """Stand-in for Ray's worker / replica group: its workers' ranks, and what it executed."""

    def __init__(self, *ranks: int) -> None:
        self.ran: list = []
        self._workers = [SimpleNamespace(distributed_context=SimpleNamespace(world_rank=r)) for r in ranks]

    def get_workers(self):
        return self._workers

    def execute(self, fn, *args):
        self.ran.append((fn, args))
        fn(*args)

    active = True

    def is_active(self) -> bool:
        return self.active

    def execute_async(self, fn, *args):
        self.execute(fn, *args)
        return []  # delivered: no reference left to wait for

    def get_replica_groups(self):
        """One replica group per worker (Ray 2.60: one worker each), made once."""
        if not hasattr(self, "_replica_groups"):
            self._replica_groups = [_Group(w.distributed_context.world_rank) for w in self._workers]
        return self._replica_groups


def _poll(**running: bool):
    return SimpleNamespace(
        worker_statuses={int(k[1:]): SimpleNamespace(running=v, error=None) for k, v in running.items()}
    )


def test_a_replacement_is_told_to_heal_or_to_end_when_its_peers_finished():
    support = ReplicaSupport(ReplicaGroups(min_replicas=1))
    try:
        support.after_worker_group_start(_Group(0, 1, 2))
        assert worker_join().kind == "start" and worker_join().settings["min_replicas"] == 1
        support.after_worker_group_poll_status(_poll(r0=True, r1=True, r2=True))
        support.after_replica_group_start(_Group(1))
        assert worker_join().kind == "replacement"  # peers still running: heal from them
        support.after_worker_group_poll_status(_poll(r0=False, r1=True, r2=False))  # 0 and 2 finished
        support.after_replica_group_start(_Group(1))
        assert worker_join().kind == "done"  # nothing left to train with
        assert [r["peers_finished"] for r in support.replacements] == [False, True]
    finally:
        set_join(None)


def test_a_replacement_still_waiting_for_a_peer_is_told_to_end_when_its_peers_finish():
    """Found in the step-failures benchmark: rank 1 killed 10 steps before the end; the
    survivor finished while the replacement started, the replacement (told "replacement")
    waited its whole ReplicaGroups.timeout_s for a peer, failed, and was replaced again:
    ~40 s of wall time after the last step."""
    support = ReplicaSupport(ReplicaGroups(min_replicas=1))
    try:
        support.after_worker_group_start(_Group(0, 1))
        support.after_worker_group_poll_status(_poll(r0=True, r1=True))
        replacement = _Group(1)
        support.after_replica_group_start(replacement)
        assert worker_join().kind == "replacement"
        support.after_worker_group_poll_status(_poll(r0=True, r1=True))
        assert worker_join().kind == "replacement"  # its peer still runs: keep waiting to heal
        support.after_worker_group_poll_status(_poll(r0=False, r1=True))  # the peer finished
        assert worker_join().kind == "done"
        told = len(replacement.ran)
        support.after_worker_group_poll_status(_poll(r0=False, r1=True))
        assert len(replacement.ran) == told  # told once
    finally:
        set_join(None)


def test_a_replacement_that_finished_is_not_told_to_end():
    support = ReplicaSupport(ReplicaGroups(min_replicas=1))
    try:
        support.after_worker_group_start(_Group(0, 1))
        replacement = _Group(1)
        support.after_replica_group_start(replacement)
        support.after_worker_group_poll_status(_poll(r0=True, r1=False))  # it healed and finished first
        support.after_worker_group_poll_status(_poll(r0=False, r1=False))
        assert [args[0].kind for _, args in replacement.ran] == ["replacement"]
    finally:
        set_join(None)


def test_a_replica_left_out_of_the_last_quorums_is_told_to_end_when_its_peers_finish():
    """With min_replicas >= 2, a replica of the whole-group start that the last quorums
    left out (slower than the lighthouse's join timeout) waited in a quorum that could
    never form once its peers finished, and its timeout failed a finished run: only
    replacements were told."""
    support = ReplicaSupport(ReplicaGroups(min_replicas=2))
    try:
        group = _Group(0, 1, 2)
        support.after_worker_group_start(group)
        laggard = group.get_replica_groups()[1]
        support.after_worker_group_poll_status(_poll(r0=True, r1=True, r2=True))
        assert laggard.ran == []
        support.after_worker_group_poll_status(_poll(r0=False, r1=True, r2=True))  # 2 still runs
        assert laggard.ran == []
        support.after_worker_group_poll_status(_poll(r0=False, r1=True, r2=False))
        assert [args[0].kind for _, args in laggard.ran] == ["done"]
        support.after_worker_group_poll_status(_poll(r0=False, r1=True, r2=False))
        assert len(laggard.ran) == 1  # told once
        assert [g.ran for i, g in enumerate(group.get_replica_groups()) if i != 1] == [[], []]
        # With min_replicas 1 it forms a quorum alone and ends the job itself (saving the
        # last step when its peers did not): not told.
        support, group = ReplicaSupport(ReplicaGroups(min_replicas=1)), _Group(0, 1, 2)
        support.after_worker_group_start(group)
        support.after_worker_group_poll_status(_poll(r0=False, r1=True, r2=False))
        assert group.get_replica_groups()[1].ran == []
    finally:
        set_join(None)


def test_a_replacement_shut_down_before_its_peers_finish_is_not_told_anything():
    """Telling a shut-down replica group raises in Ray ("ReplicaGroup has been shut down"),
    which in a controller callback would end the run."""
    support = ReplicaSupport(ReplicaGroups(min_replicas=1))
    try:
        support.after_worker_group_start(_Group(0, 1))
        gone, stale = _Group(1), _Group(1)
        support.after_replica_group_start(gone)
        support.before_replica_group_shutdown(gone)
        support.after_replica_group_start(stale)
        stale.active = False  # shut down without the hook
        support.after_worker_group_poll_status(_poll(r0=False, r1=True))
        assert len(gone.ran) == 1 and len(stale.ran) == 1  # only the join each got at its start
    finally:
        set_join(None)


def _dead(actor) -> bool:
    import ray

    try:
        ray.get(actor.address.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_the_lighthouse_starts_with_the_controller_and_the_backend_takes_it_instead_of_making_one(ray_local):
    """Ray's backend would create the lighthouse after the workers are up and wait for it;
    ReplicaSupport starts it at the controller's start and the backend uses that actor."""
    import ray

    settings = ReplicaGroups()
    config = replica_kwargs(settings, ray.train.RunConfig(), {})[1]["torch_config"]
    support = ReplicaSupport(settings, lighthouse_kwargs=config.lighthouse_kwargs)
    support.after_controller_start(SimpleNamespace())
    started = _replicas._started_lighthouse
    assert started is not None
    backend = config.backend_cls()
    address = backend._maybe_create_lighthouse_actor(config)
    try:
        assert backend.lighthouse_actor is started  # Ray's path creates one only when none is set
        assert _replicas._started_lighthouse is None
        assert address == ray.get(started.address.remote(), timeout=60)
        assert address.startswith("http://")
        # A later call (a replacement's start) reads the same actor's address.
        assert backend._maybe_create_lighthouse_actor(config) == address
        # A dead lighthouse: Ray's backend asked the dead actor at every later start, so
        # every whole-group restart failed to start, for as long as Ray retried it.
        ray.kill(started)
        wait_for(lambda: _dead(started), timeout_s=60, what="the killed lighthouse gone")
        backend.replace_dead_lighthouse(config.lighthouse_kwargs)  # what a whole-group start does first
        again = backend._maybe_create_lighthouse_actor(config)
        assert backend.lighthouse_actor is not started and again.startswith("http://")
        assert again == ray.get(backend.lighthouse_actor.address.remote(), timeout=60)
    finally:
        ray.kill(started)
        if backend.lighthouse_actor is not started:
            ray.kill(backend.lighthouse_actor)


def test_only_a_controller_that_ended_on_a_dead_worker_is_run_again():
    from ray.train.v2.api.exceptions import ControllerError

    assert replacement_raced(ControllerError(ray.exceptions.ActorDiedError()))
    assert not replacement_raced(ControllerError(ValueError("a bug in a callback")))
    assert not replacement_raced(ControllerError(TimeoutError("placement group not ready")))


def test_a_rerun_of_fit_gets_rays_failure_budgets_less_what_the_runs_before_used():
    """Each re-run used to start FailureConfig.max_failures afresh: a run allowed 2 failures
    could fail 2 more times after every re-run."""
    config = ray.train.FailureConfig(max_failures=4, max_preemption_failures=3)
    left = rerun_failure_config(config, {"max_failures": 2, "max_preemption_failures": 1})
    assert (left.max_failures, left.max_preemption_failures) == (2, 2)
    assert left.controller_failure_limit == config.controller_failure_limit  # the rest as given
    assert rerun_failure_config(config, {"max_failures": 4}).max_failures == 0  # no retry left, still a run
    assert rerun_failure_config(config, {"max_failures": 5}) is None  # Ray would have raised at the 5th
    assert rerun_failure_config(config, {"max_preemption_failures": 4}) is None
    unlimited = ray.train.FailureConfig(max_failures=-1)
    assert rerun_failure_config(unlimited, {"max_failures": 100}).max_failures == -1
