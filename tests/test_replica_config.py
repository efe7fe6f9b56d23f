"""Replica mode's settings, the trainer arguments it sets, and what workers are told (the
driver's hooks get stand-ins of Ray's worker-group objects; the lighthouse test starts real
actors on the shared local Ray)."""

from __future__ import annotations

import contextlib
import importlib.util
from types import SimpleNamespace

import pytest
import ray.train
import torch
from ray.train.v2.torch.torchft_config import TorchftConfig

from ray_goodput.driver import _replicas
from ray_goodput.driver._replicas import EarlyLighthouseConfig, ReplicaSupport, replica_kwargs
from ray_goodput.driver._trainer import replacement_raced, rerun_failure_config
from ray_goodput.errors import ConfigError
from ray_goodput.replica import ReplicaGroups
from ray_goodput.runtime import WorkerContext, world_of_one
from ray_goodput.runtime._join import WorkerJoin, set_join, worker_join
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


@contextlib.contextmanager
def _joined(kind: str):
    """This process's join for the block, as the driver sets it in a worker."""
    set_join(WorkerJoin(kind))
    try:
        yield
    finally:
        set_join(None)


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


class _AloneInQuorum:
    """Stand-in for torchft's Manager in a quorum of one at step 0 (its peers are gone)."""

    def start_quorum(self, timeout=None) -> None:
        pass

    def num_participants(self) -> int:
        return 1

    def current_step(self) -> int:
        return 0


class _FreshQuorum(_AloneInQuorum):
    """A quorum of ``n`` replicas at step 0: none has progress to heal from."""

    def __init__(self, n: int) -> None:
        self.n = n

    def num_participants(self) -> int:
        return self.n


def _waiting_replacement(timeout_s: float, *, configured: int = 2, manager=None):
    from ray_goodput.replica._replica import Replica

    rep = Replica.__new__(Replica)  # the first-quorum wait alone: no torchft, no Ray
    rep.settings = ReplicaGroups(heartbeat_timeout_s=0.2, timeout_s=timeout_s)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished = 1, configured, True, False
    rep.manager, rep._first_quorum, rep._drop_step = manager or _AloneInQuorum(), True, False
    rep._durable = _durable(rep, slot=1, save_every=10)
    return rep


def _durable(rep, *, slot: int, save_every: int | None, root: str | None = None, timeout_s: float = 30.0):
    """The replica's durable fallback as ``Replica.__init__`` makes it (nothing opened)."""
    from ray_goodput.replica._durable import DurableCopy

    return DurableCopy(slot, save_every, root, {"uploader": "thread"}, lambda: rep._durable_state(), timeout_s)


def test_two_fresh_replacements_of_three_do_not_step_from_scratch_without_replica_0():
    """Every replica of 3 failed and Ray replaced them one by one: replacements 1 and 2
    met at step 0 before replica 0's. They stepped from scratch together, replica 0's
    replacement then healed from them instead of restoring, and the durable checkpoint was
    thrown away. Now they wait for replica 0 (here it never comes: the wait ends at its
    bound)."""
    from ray_goodput.replica._replica import ReplicaJoinError

    rep = _waiting_replacement(timeout_s=0.5, configured=3, manager=_FreshQuorum(2))
    with _joined("replacement"):
        with pytest.raises(ReplicaJoinError, match=r"2 of 3 replicas"):
            rep._join_quorum()


class _QuorumAtTheEnd(_FreshQuorum):
    """A whole-group start's first quorum of ``n`` replicas whose newest checkpoint is the
    job's last step: replica 0 restored it before the quorum, the others heal to it there."""

    def __init__(self, n: int, step: int, *, restored: bool) -> None:
        super().__init__(n)
        self.step, self.quorums = (step if restored else 0), 0
        self.end = step

    def start_quorum(self, timeout=None) -> None:
        self.quorums += 1
        self.step = self.end  # replica 0 sends its state; a healing replica loads it

    def current_step(self) -> int:
        return self.step


@pytest.mark.parametrize("slot", [0, 1])
def test_a_finished_job_started_again_ends_every_replica_at_the_first_quorum(slot):
    """Started again on the storage of a finished job, replica 0 restored its last step
    and ended without a quorum; the others waited for it at their first quorum until
    timeout_s and failed (and with 3 replicas were replaced again and again, until the
    failure budget ended the finished run as failed). Replica 0 now meets the others once,
    they heal to the last step there, and every replica ends without a step or a save."""
    rep = _waiting_replacement(timeout_s=5.0, configured=3, manager=_QuorumAtTheEnd(3, 50, restored=slot == 0))
    rep.replacement, rep.slot = False, slot
    rep._in_step, rep._optim = False, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    rep._rank_in_step = -1
    with _joined("start"):
        assert list(rep.batches(total_steps=50)) == []
        assert rep.manager.quorums == 1 and rep.current_step == 50


class _WhileReplica0Restores(_FreshQuorum):
    """A whole-group start's first quorum while replica 0 restores a large checkpoint for
    ``restore_s``: with min_replicas = configured, torchft's quorum forms only when its
    timeout outlasts the restore, else it raises (and torchft 0.2.0 raises that error again
    at every later start_quorum: a failed quorum cannot be tried again)."""

    def __init__(self, n: int, restore_s: float) -> None:
        super().__init__(n)
        self.restore_s, self.timeouts = restore_s, []

    def start_quorum(self, timeout=None) -> None:
        self.timeouts.append(timeout)
        if timeout is None or timeout.total_seconds() < self.restore_s:
            raise TimeoutError("quorum timed out")  # as torchft's client raises it


def _starting_replica(manager, **settings):
    rep = _waiting_replacement(timeout_s=settings.get("timeout_s", 0.5), configured=2, manager=manager)
    rep.replacement = False  # a whole-group start: replica 0 restores before its first quorum
    rep.settings = ReplicaGroups(min_replicas=2, heartbeat_timeout_s=0.1, **settings)
    return rep


def test_a_whole_group_start_waits_past_timeout_s_for_replica_0_restoring_a_large_checkpoint():
    """Replica 0 restores the checkpoint before it joins a quorum. The other replicas' first
    quorum failed after timeout_s (30 s by default), less than a multi-GB restore from
    object storage takes: each raised and was replaced, a failure charged to it and to its
    healthy node (two such restarts isolate it). Their first quorum is now bounded by
    start_timeout_s: one quorum call, as torchft cannot try a failed one again."""
    manager = _WhileReplica0Restores(2, restore_s=100.0)
    rep = _starting_replica(manager, timeout_s=30.0, start_timeout_s=600.0)
    with _joined("start"):
        rep._join_quorum()
        assert len(manager.timeouts) == 1 and manager.timeouts[0].total_seconds() > 599.0


def test_a_whole_group_start_whose_replica_0_never_comes_fails_naming_start_timeout_s():
    from ray_goodput.replica._replica import ReplicaJoinError

    rep = _starting_replica(_WhileReplica0Restores(2, restore_s=10**6), timeout_s=30.0, start_timeout_s=60.0)
    with _joined("start"):
        with pytest.raises(ReplicaJoinError, match=r"start_timeout_s"):
            rep._join_quorum()


class _QuorumNeverFormed(_AloneInQuorum):
    """torchft's quorum with ``min_replicas`` 2 when every peer has finished: it waits out
    its timeout and raises; meanwhile the driver tells the replacement its peers are done."""

    def start_quorum(self, timeout=None) -> None:
        set_join(WorkerJoin("done"))
        raise TimeoutError("quorum timed out")  # as torchft's client raises it

    def num_participants(self) -> int:
        raise AssertionError("no quorum formed: nothing to ask")


def test_a_replacement_whose_peers_finished_while_its_quorum_could_not_form_ends_cleanly():
    """With min_replicas >= 2, a replacement whose peers all finished while it started
    waited in a quorum that could never form, and its timeout was a failure of the run:
    charged to max_failures, the replica replaced again, and a run that had finished
    could end failed. It ends with nothing to train, as when told before its quorum."""
    rep = _waiting_replacement(timeout_s=5.0, configured=2, manager=_QuorumNeverFormed())
    rep.settings = ReplicaGroups(min_replicas=2, heartbeat_timeout_s=0.2, timeout_s=5.0)
    rep._in_step, rep._optim = False, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with _joined("replacement"):
        assert list(rep.batches(total_steps=10)) == []
        assert rep.peers_finished


def test_a_replacement_whose_quorum_fails_while_its_peers_still_train_raises():
    rep = _waiting_replacement(timeout_s=5.0, configured=2, manager=_QuorumNeverFormed())
    rep.manager.start_quorum = lambda timeout=None: (_ for _ in ()).throw(TimeoutError("quorum timed out"))
    rep._in_step, rep._optim = False, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with _joined("replacement"):
        with pytest.raises(TimeoutError, match="quorum timed out"):
            list(rep.batches(total_steps=10))


def test_a_fresh_replacement_that_meets_every_replica_at_step_0_does_not_commit_that_step():
    """Replica 0's replacement restores the checkpoint inside this quorum and drops the
    step; another fresh replacement that committed it kept a step computed from fresh
    weights (with a checkpoint of step 1, the two then stood at step 1 with different
    weights and never healed). It drops the step and heals from replica 0 at the next
    quorum; so it does at every quorum until it has progress."""
    rep = _waiting_replacement(timeout_s=5.0, configured=2, manager=_FreshQuorum(2))
    with _joined("replacement"):
        rep._join_quorum()
        assert rep._drop_step
        rep._drop_step = False  # the step did not commit (no peer was ahead): still no progress
        rep._join_quorum()
        assert rep._drop_step


class _HealingQuorum(_AloneInQuorum):
    """torchft's synchronous quorum healing this replica from a peer at ``step``: it loads
    the peer's state through the replica's callback, then stands at the peer's step."""

    def __init__(self, rep, peer_state: dict, step: int) -> None:
        self.rep, self.peer_state, self.step, self.healed_to = rep, peer_state, 0, step

    def start_quorum(self, timeout=None) -> None:
        self.rep._load_heal_state(self.peer_state)
        self.step = self.healed_to

    def num_participants(self) -> int:
        return 2

    def current_step(self) -> int:
        return self.step


def test_a_replacement_of_replica_0_records_its_heal_as_a_restore_of_the_peers_step():
    """Replica 0 writes the goodput timeline. Its replacement healed from a peer at step 12
    and recorded no restore: the ledger counted the replaced process's 12 steps as lost and
    the replacement's first step as 13 steps of its own."""
    import torch

    from ray_goodput.goodput._recorder import StepRecorder
    from ray_goodput.replica import _position as pos

    class _Log:  # the recorder's sink: the events it would write
        def __init__(self) -> None:
            self.events: list[tuple[str, dict]] = []

        def emit(self, name: str, **fields) -> None:
            self.events.append((name, fields))

    model = torch.nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    peer = {"model": model.state_dict(), "optim": optim.state_dict(), "position": pos.Position().to_dict(), "extra": {}}
    rep = _waiting_replacement(timeout_s=5.0, configured=2)
    rep.slot, rep._model, rep._optim, rep._extra, rep._healed = 0, model, optim, {}, False
    rep._recorder = StepRecorder(_Log())
    rep.manager = _HealingQuorum(rep, peer, 12)
    with _joined("replacement"):
        rep._join_quorum()
    restores = [f for name, f in rep._recorder.log.events if name == "restore"]
    assert [r["step"] for r in restores] == [12]
    rep._recorder.step(13)
    assert rep._recorder.log.events[-1][1]["n"] == 1  # one step of its own, not 13


def test_a_waiting_replacement_ends_when_told_its_peers_finished_instead_of_timing_out():
    import threading

    rep = _waiting_replacement(timeout_s=30.0)
    set_join(WorkerJoin("replacement"))
    told = threading.Timer(0.3, set_join, [WorkerJoin("done")])
    told.start()
    try:
        rep._join_quorum()  # returns once told (the old loop raised ReplicaJoinError after 30 s)
        assert rep.peers_finished
    finally:
        told.cancel()
        set_join(None)


def test_a_replacement_alone_and_never_told_fails_naming_the_timeout():
    from ray_goodput.replica._replica import ReplicaJoinError

    rep = _waiting_replacement(timeout_s=0.5)
    with _joined("replacement"):
        with pytest.raises(ReplicaJoinError, match=r"timeout_s"):
            rep._join_quorum()
        assert not rep.peers_finished


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


def test_a_replica_of_the_start_whose_quorum_fails_after_its_peers_finished_ends_cleanly():
    rep = _waiting_replacement(timeout_s=5.0, configured=3, manager=_QuorumNeverFormed())
    rep.replacement, rep.slot = False, 1  # started with the group; the last quorums left it out
    rep.settings = ReplicaGroups(min_replicas=2, heartbeat_timeout_s=0.2, timeout_s=5.0)
    rep._in_step, rep._optim = False, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    rep._first_quorum = False  # it has stepped with its peers
    with _joined("start"):
        assert list(rep.batches(total_steps=10)) == []
        assert rep.peers_finished


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


class _Calls:
    """Stand-ins that record, in order, what closing a ``Replica`` does to its parts."""

    def __init__(self, close_raises: bool = False) -> None:
        self.calls: list[str] = []
        self.close_raises = close_raises

    def shutdown(self, wait: bool) -> None:  # torchft's Manager
        self.calls.append(f"manager.shutdown(wait={wait})")

    def close(self) -> None:  # the Checkpointer: waits for the last save
        self.calls.append("checkpointer.close")
        if self.close_raises:
            from ray_goodput import CheckpointError

            raise CheckpointError("the last save did not commit")

    def __exit__(self, *exc: object) -> None:  # the Checkpointer unwinding an error
        self.calls.append("checkpointer.release")

    def end(self) -> None:  # the goodput recorder
        self.calls.append("recorder.end")


def _closing_replica(parts: _Calls):
    from ray_goodput.replica._replica import Replica

    rep = Replica.__new__(Replica)
    rep.slot, rep.manager, rep._recorder = 0, parts, parts
    rep._durable = _durable(rep, slot=0, save_every=5)
    rep._durable.ckpt = parts
    return rep


def test_an_error_in_the_loop_leaves_the_quorum_at_once_and_is_raised_as_it_was():
    """Replica 0's loop raised: it used to wait for its uploads (up to the Checkpointer's
    wait_timeout_s) while its Manager heartbeated without joining, stalling the survivors'
    quorums, and a failed last save replaced the loop's error (Recovery decides on its
    type), and the ledger recorded a clean end."""
    parts = _Calls(close_raises=True)
    with pytest.raises(ValueError, match="the user's loop"):
        with _closing_replica(parts):
            raise ValueError("the user's loop")
    assert parts.calls == ["manager.shutdown(wait=False)", "checkpointer.release"]


def test_a_clean_end_leaves_the_quorum_before_it_waits_for_the_last_save():
    parts = _Calls()
    with _closing_replica(parts):
        pass
    assert parts.calls == ["manager.shutdown(wait=False)", "checkpointer.close", "recorder.end"]


class _Collective:
    """torchft's Manager for one step: an all-reduce that records what it was sent (and
    leaves it: a mean over one participant), and a commit vote."""

    def __init__(self, commits: bool = True) -> None:
        self.sent: list[int] = []
        self.commits = commits

    def allreduce(self, tensor: torch.Tensor):
        self.sent.append(tensor.numel())
        return SimpleNamespace(wait=lambda: None)

    def should_commit(self) -> bool:
        return self.commits

    def current_step(self) -> int:
        return 4


def _stepping_replica(model: torch.nn.Module, manager: _Collective):
    from ray_goodput.replica._replica import Replica

    rep = Replica.__new__(Replica)
    rep.slot, rep._model, rep.manager = 1, model, manager
    rep._in_step, rep._drop_step, rep._retrying, rep._uncommitted = True, False, False, 0
    rep._recorder = SimpleNamespace(uncommitted=lambda: None)
    return rep


def test_a_parameter_the_batch_left_without_a_gradient_keeps_the_all_reduce_layout_of_every_replica():
    """A branch taken by one replica's batch and not another's (a conditional head, MoE):
    the flat all-reduce held only the parameters with a gradient, so the replicas sent
    different sizes (the step never committed) or, when the sizes matched, added unrelated
    gradients together. Now every parameter is sent (zeros where unused here); one that a
    peer used gets the mean, one that no participant used keeps no gradient."""
    model = torch.nn.ModuleDict(
        {"used": torch.nn.Linear(3, 2), "peers": torch.nn.Linear(3, 4), "nobody": torch.nn.Linear(3, 1)}
    )
    model["used"](torch.ones(1, 3)).sum().backward()
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    peers = [i for i, name in enumerate(n for n, _ in model.named_parameters()) if name.startswith("peers")]

    class _WithAPeer(_Collective):
        """The mean with one peer whose batch took the ``peers`` branch (gradient 1.0)."""

        def allreduce(self, tensor: torch.Tensor):
            super().allreduce(tensor)
            grads, flags = tensor[: sum(sizes)], tensor[sum(sizes) :]
            for i in peers:
                start = sum(sizes[:i])
                grads[start : start + sizes[i]] = (grads[start : start + sizes[i]] + 1.0) / 2
                flags[i] = (flags[i] + 1.0) / 2
            return SimpleNamespace(wait=lambda: None)

    manager = _WithAPeer()
    _stepping_replica(model, manager)._average_gradients()
    assert manager.sent == [sum(sizes) + len(params)]  # the same on every replica
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model["peers"].parameters())
    assert all(p.grad is None for p in model["nobody"].parameters())  # the optimizer leaves it


def test_steps_that_never_commit_end_in_an_error_that_says_so_instead_of_retrying_for_ever():
    from ray_goodput.replica._replica import MAX_UNCOMMITTED_STEPS, ReplicaStepError

    rep = _stepping_replica(torch.nn.Linear(2, 1), _Collective(commits=False))
    for _ in range(MAX_UNCOMMITTED_STEPS - 1):
        assert rep.step() is False
        rep._in_step = True  # the next try of the same step
    with pytest.raises(ReplicaStepError, match=rf"step 5 did not commit {MAX_UNCOMMITTED_STEPS} times in a row"):
        rep.step()


class _LastSteps(_Collective, _AloneInQuorum):
    """torchft's Manager over a job's last steps: every step commits, with this replica the
    step's only participant (its peers, replica 0 among them, were being replaced)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def participating_rank(self) -> int:
        return 0

    def current_step(self) -> int:
        return self.step

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def batches_committed(self) -> int:
        return self.step

    def shutdown(self, wait: bool) -> None:
        pass


def _end_job_as_survivor(root: str, model: torch.nn.Module, *, last: int = 9) -> None:
    """Replica 1 steps from 7 to the job's ``last`` step as the only participant, and ends."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished = 1, 2, False, False
    rep.settings = ReplicaGroups(timeout_s=10.0)
    rep.manager, rep._durable = _LastSteps(step=7), _durable(rep, slot=1, save_every=5, root=root, timeout_s=10.0)
    rep._model, rep.model, rep._optim, rep._extra = model, model, torch.optim.SGD(model.parameters(), lr=0.1), {}
    rep._dataset, rep._batch_size, rep._seed, rep._shuffle = torch.arange(64.0), 4, 0, False
    rep._collate, rep._order, rep._position = torch.stack, None, Position()
    rep._rank_in_step, rep._participants = -1, 0
    rep._in_step, rep._first_quorum, rep._drop_step, rep._retrying, rep._uncommitted = False, False, False, False, 0
    rep._recorder = SimpleNamespace(step=lambda *a, **k: None, uncommitted=lambda: None, end=lambda: None)
    with rep:
        for batch in rep.batches(total_steps=last):
            model(batch[:, None]).sum().backward()
            assert rep.step()
    assert rep.current_step == last


def _restored(root: str) -> tuple[int | None, torch.Tensor]:
    from ray_goodput import Checkpointer

    fresh = torch.nn.Linear(1, 1)
    with Checkpointer(root, uploader="thread") as ckpt:
        return ckpt.restore({"model": fresh}), fresh.weight.detach().clone()


def test_a_survivor_that_ends_the_job_while_replica_0_is_replaced_saves_the_last_step(tmp_path):
    """Only replica 0 saved, every ``save_every`` steps: the steps after its last save, and
    all of the job's end when replica 0 was being replaced then, lived only in the
    survivors' processes, and the run ended with no checkpoint of its final state."""
    model = torch.nn.Linear(1, 1)
    _end_job_as_survivor(str(tmp_path / "ckpt"), model)
    step, weight = _restored(str(tmp_path / "ckpt"))
    assert step == 9 and torch.equal(weight, model.weight)


def test_a_survivor_does_not_save_again_a_last_step_replica_0_committed(tmp_path):
    """Replica 0 committed the last step, saved it and ended, while the survivor's vote on
    that step failed, so it computed the step again alone: its save, a newer generation,
    would have replaced replica 0's (the step both replicas committed together)."""
    from ray_goodput import Checkpointer

    root = str(tmp_path / "ckpt")
    replica_0 = torch.nn.Linear(1, 1)
    with Checkpointer(root, uploader="thread") as ckpt:
        ckpt.save(9, {"model": replica_0})
    _end_job_as_survivor(root, torch.nn.Linear(1, 1))
    step, weight = _restored(root)
    assert step == 9 and torch.equal(weight, replica_0.weight)


def test_replica_0s_replacement_that_restored_the_last_step_ends_without_saving_it_again(tmp_path):
    """The survivor ended the job while replica 0 was being replaced and saved the last
    step; the replacement, with no peer left to heal from, restored that very step, and its
    final save of it raised ConfigError ("not after the last saved step"): not retryable,
    so a run that had finished and committed its last step failed."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    class _Restores(_LastSteps):
        def load_state_dict(self, state: dict) -> None:
            self.step = state["step"]

    root = str(tmp_path / "ckpt")
    survivor = torch.nn.Linear(1, 1)
    _end_job_as_survivor(root, survivor)
    rep = Replica.__new__(Replica)
    rep.slot, rep.replacement, rep.settings, rep._extra = 0, True, ReplicaGroups(timeout_s=30.0), {}
    rep.manager, rep._position, rep._batches_restored = _Restores(step=0), Position(), 0
    rep._model = rep.model = model = torch.nn.Linear(1, 1)
    rep._optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rep._rank_in_step, rep._participants, rep.configured = 0, 1, 2
    rep._durable = _durable(rep, slot=0, save_every=5, root=root)
    rep._durable.open()
    try:
        assert rep._restore_if_no_peer_had_state() is True and rep.current_step == 9
        rep._save_final()
    finally:
        rep._durable.close()
    step, weight = _restored(root)
    assert step == 9 and torch.equal(weight, survivor.weight)


def test_replica_0_late_to_the_last_step_does_not_save_it_over_a_survivors_newer_generation(tmp_path):
    """With 3 replicas, replica 0 reached the last quorum after its peers had committed the
    last step without it and ended (the survivor that led it saved it, a new generation);
    replica 0 computed the step alone and saved it in its own, older generation: fenced,
    and a run that had finished and committed its last step failed with FencedError."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    root = str(tmp_path / "ckpt")
    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep._extra = 0, 3, False, {}
    rep.settings = ReplicaGroups(timeout_s=30.0)
    rep.manager, rep._position, rep._batches_restored = _LastSteps(step=5), Position(), 0
    rep._model = rep.model = model = torch.nn.Linear(1, 1)
    rep._optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rep._durable = _durable(rep, slot=0, save_every=5, root=root)
    rep._durable.open()  # replica 0's, from the job's start
    try:
        rep._durable.save_if_due(5)
        rep._durable.ckpt.wait()
        survivor = torch.nn.Linear(1, 1)
        _end_job_as_survivor(root, survivor)  # steps 8 and 9 without replica 0; saves 9
        rep.manager.step, rep._rank_in_step, rep._participants = 9, 0, 1
        rep._save_final()  # step 9, computed alone after the others ended
    finally:
        rep._durable.close()
    step, weight = _restored(root)
    assert step == 9 and torch.equal(weight, survivor.weight)


def test_replica_0_late_to_a_last_step_due_for_its_periodic_save_does_not_save_it_over_a_newer_generation(
    tmp_path,
):
    """As above, with the last step a multiple of save_every: replica 0's periodic save,
    made inside step(), skipped the check that the final save makes, saved the step in its
    older generation, and close() raised FencedError for a run that had finished."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    root = str(tmp_path / "ckpt")
    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished, rep._extra = 0, 3, False, False, {}
    rep.settings = ReplicaGroups(timeout_s=30.0)
    rep.manager, rep._position, rep._batches_restored = _LastSteps(step=5), Position(), 0
    rep._model = rep.model = model = torch.nn.Linear(1, 1)
    rep._optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rep._dataset, rep._batch_size, rep._seed, rep._shuffle = torch.arange(64.0), 4, 0, False
    rep._collate, rep._order, rep._rank_in_step, rep._participants = torch.stack, None, -1, 0
    rep._in_step, rep._first_quorum, rep._drop_step, rep._retrying, rep._uncommitted = False, False, False, False, 0
    rep._recorder = SimpleNamespace(step=lambda *a, **k: None, uncommitted=lambda: None, end=lambda: None)
    rep._durable = _durable(rep, slot=0, save_every=5, root=root)
    rep._durable.open()  # replica 0's, from the job's start
    rep._durable.save_if_due(5)
    rep._durable.ckpt.wait()
    survivor = torch.nn.Linear(1, 1)
    _end_job_as_survivor(root, survivor, last=10)  # steps 8 to 10 without replica 0; saves 10
    rep.manager.step = 9
    with rep:  # step 10, computed alone after the others ended (a FencedError at close before)
        for batch in rep.batches(total_steps=10):
            model(batch[:, None]).sum().backward()
            assert rep.step()
    step, weight = _restored(root)
    assert step == 10 and torch.equal(weight, survivor.weight)


def test_a_step_that_rolled_into_the_next_epoch_and_did_not_commit_leaves_the_epoch_where_it_was():
    """10 samples, batch 2: with 3 replicas the second step needs 6 of the 4 left, so it
    rolled over into epoch 1. The step did not commit (a peer died in it) and was retried
    with 1 replica, which fit in epoch 0's remainder; the position had already moved on,
    and those 4 samples of epoch 0 were never read (more than the tail of fewer than P*B
    that the rule drops)."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    class _Scripted(_Collective):
        """Each try of a step: (participants, whether it commits)."""

        def __init__(self, tries: list[tuple[int, bool]]) -> None:
            super().__init__()
            self.tries, self.step, self.now = list(tries), 0, (0, False)

        def start_quorum(self, timeout=None) -> None:
            self.now = self.tries.pop(0)

        def num_participants(self) -> int:
            return self.now[0]

        def participating_rank(self) -> int:
            return 0

        def current_step(self) -> int:
            return self.step

        def should_commit(self) -> bool:
            self.step += self.now[1]
            return self.now[1]

    model = torch.nn.Linear(1, 1)
    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished = 1, 3, False, False
    rep.manager = _Scripted([(3, True), (3, False), (1, True)])
    rep._model, rep._optim = model, torch.optim.SGD(model.parameters(), lr=0.1)
    rep._durable = _durable(rep, slot=1, save_every=None)
    rep._dataset, rep._batch_size, rep._position, rep._participants = torch.arange(10.0), 2, Position(), 0
    rep._in_step, rep._first_quorum, rep._retrying, rep._uncommitted, rep._drop_step = False, False, False, 0, False
    rep._order, rep._seed, rep._shuffle, rep._collate = None, 0, False, torch.stack
    rep._recorder = SimpleNamespace(step=lambda *a, **k: None, uncommitted=lambda: None)
    read = []
    for batch in rep.batches(total_steps=2):
        read.append(batch.tolist())
        model(batch[:, None]).sum().backward()
        rep.step()
    assert read == [[0.0, 1.0], [0.0, 1.0], [6.0, 7.0]], read  # the retry reads epoch 0's samples 6-7
    assert rep.position.epoch == 0


def test_a_dataset_smaller_than_one_step_is_refused_naming_the_fix_not_read_as_a_short_batch():
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    class _Two(_LastSteps):
        def num_participants(self) -> int:
            return 2

    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished = 0, 2, False, False
    rep.manager, rep._optim = _Two(step=0), torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    rep._dataset, rep._batch_size, rep._position, rep._participants = torch.arange(6.0), 4, Position(), 0
    rep._in_step, rep._first_quorum, rep._retrying = False, False, False
    rep._order, rep._seed, rep._shuffle, rep._collate = None, 0, False, torch.stack
    rep._durable = _durable(rep, slot=0, save_every=None)
    with pytest.raises(ConfigError, match=r"6 samples, fewer than one step of 2 replicas × batch_size 4"):
        next(rep.batches(total_steps=3))


def test_a_survivor_saves_the_last_step_when_only_an_older_lineage_has_it(tmp_path):
    """Storage holds step 9 from a dead attempt (an older generation) and step 5 from the
    newer one that resumed before it: a restore takes step 5. The survivor looked for a
    committed step 9 by number alone, skipped its save, and the job's last steps were lost."""
    from ray_goodput import Checkpointer

    root = str(tmp_path / "ckpt")
    with Checkpointer(root, uploader="thread") as dead_attempt:
        dead_attempt.save(9, {"model": torch.nn.Linear(1, 1)})
    with Checkpointer(root, uploader="thread") as resumed:  # the next generation
        resumed.save(5, {"model": torch.nn.Linear(1, 1)})
    assert _restored(root)[0] == 5
    model = torch.nn.Linear(1, 1)
    _end_job_as_survivor(root, model)
    step, weight = _restored(root)
    assert step == 9 and torch.equal(weight, model.weight)


def test_replica_0s_restore_inside_a_quorum_bounds_its_upload_wait_for_that_restore_only(tmp_path, monkeypatch):
    """Its peers wait for it in the step's all-reduce, so its wait for a dead replica 0's
    uploads is capped below ``timeout_s``; the cap stayed on the process, so any later
    restore there (the user's own) was capped too."""
    from ray_goodput.checkpoint import _checkpointer
    from ray_goodput.replica._replica import Replica
    from ray_goodput.runtime._resume import restore_upload_wait_s

    waits = []
    monkeypatch.setattr(_checkpointer, "ray_initialized", lambda: True)  # as under Ray
    monkeypatch.setattr(
        _checkpointer, "wait_for_uploads", lambda root, *, above, timeout_s: waits.append(timeout_s) or {}
    )
    rep = Replica.__new__(Replica)
    rep.replacement, rep.settings, rep._extra = True, ReplicaGroups(timeout_s=30.0), {}
    rep.manager = SimpleNamespace(current_step=lambda: 0)
    rep._model = model = torch.nn.Linear(1, 1)
    rep._optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rep._durable = _durable(rep, slot=0, save_every=5, root=str(tmp_path / "ckpt"))
    rep._durable.open()
    try:
        assert rep._restore_if_no_peer_had_state() is False  # nothing committed yet
    finally:
        rep._durable.close()
    assert waits == [10.0]
    assert restore_upload_wait_s(str(tmp_path / "ckpt"), 120.0) == 120.0
