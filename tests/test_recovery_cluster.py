"""Driver-side Recovery on a real multi-node Ray cluster.

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
from ray.train.v2.api.exceptions import ControllerError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_goodput.driver._record import load_state
from ray_goodput.driver._recovery import Recovery
from ray_goodput.driver._trainer import TorchTrainer
from ray_goodput.errors import StateMismatchError
from ray_goodput.runtime import _resume
from ray_goodput.testing import publish_file, wait_for
from tests._node_checks import FailsOn


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    x = c.add_node(num_cpus=2)
    y = c.add_node(num_cpus=1)
    z = c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)  # the nodes' processes inherit this one's environment
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
