"""Recovery: the driver-side half of fault tolerance, as a Ray Train controller callback.

It runs in the Ray Train controller (Ray 2.60 DeveloperAPI hooks) and does three things:

* **Resume point chosen once.** Before every attempt after the first it finds the newest
  intact committed checkpoint and hands that step to every worker of the new group
  (``ray_goodput.runtime._resume``) before the training function starts. The choice
  (``_resume_choice``) begins when the failure is seen, and placement does not wait for it.
* **Futile retries stopped.** When a worker raised an error that a restart cannot fix
  (``ray_goodput.errors.NOT_RETRYABLE``, classified by type after unwrapping Ray's
  wrappers), Ray's RETRY decision is vetoed: the hook re-raises that error, Ray turns it into
  a non-retryable ``ControllerError`` and the run ends with it, whatever ``max_failures``.
* **Unhealthy nodes isolated.** Failures are counted per node (a worker raised or died
  there, or the node failed its health check before an attempt). A node that reaches
  ``max_failures_per_node`` gets no worker of this run again: the worker group's label
  selector excludes it (``ray.io/node-id: "!in(...)"``), unless the run could not be
  placed without it. Unhealthy nodes that leave no room for the workers at that many
  starts in a row end the run (``NoHealthyNodesError``). The room and the selector are
  ``_placement``'s arithmetic.

What it decided is kept in ``<root>/recovery/state.json`` (``_record``: the layout, and the
background writer no restart hook waits for) for the goodput summary, MLflow and
``ray-goodput status``: the controller runs on a copy of the Recovery the user built, so
the user's object learns nothing by itself.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import ray
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
from ray.train.v2._internal.execution.callback import ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from ray_goodput.driver import _gpu_check, _health, _placement
from ray_goodput.driver._record import ABORT_WRITE_WAIT_S, STATE_WRITE_WAIT_S, StateWriter
from ray_goodput.driver._resume_choice import UPLOAD_WAIT_S, ResumeChoice
from ray_goodput.errors import ConfigError, NoHealthyNodesError, not_retryable, peers_failed
from ray_goodput.runtime import run_root
from ray_goodput.runtime._resume import root_key, set_decision
from ray_goodput.storage import StorageLocation, resolve

logger = logging.getLogger(__name__)

#: Ray reads it in the controller when it tears a worker group's process group down.
TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"
#: The ``FailureConfig`` fields whose budgets ``Recovery.failures_charged`` counts.
MAX_FAILURES = "max_failures"
MAX_PREEMPTION_FAILURES = "max_preemption_failures"


def unwrap(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors Ray Train wraps in it: each worker's failure, the controller's
    failure, the actor error behind a failed worker health check."""
    found, todo = [], [exc]
    while todo:
        cur = todo.pop()
        found.append(cur)
        if isinstance(cur, WorkerGroupError):
            todo += list(cur.worker_failures.values())
        elif isinstance(cur, ControllerError):
            todo.append(cur.controller_failure)
        elif isinstance(cur, WorkerHealthCheckFailedError):
            todo.append(cur.health_check_failure)
    return found


def futile(exc: BaseException) -> BaseException | None:
    """The error inside ``exc`` that a retry cannot fix, or None."""
    return next((hit for e in unwrap(exc) if (hit := not_retryable(e)) is not None), None)


def stop_record(attempt: int | str, rank: int | None, error: BaseException) -> dict[str, str]:
    """What the run's record says stopped it: the attempt, the rank ("" for the driver's
    own stop) and the error."""
    return {
        "attempt": str(attempt),
        "rank": "" if rank is None else str(rank),
        "error": f"{type(error).__name__}: {error}",
    }


def _preempted(exc: BaseException) -> bool:
    return any(getattr(e, "preempted", False) for e in unwrap(exc))


def _has_preempted_worker(worker_group_status: Any) -> bool:
    """Whether Ray's poll counts a worker as preempted (its errors are then collateral)."""
    check = getattr(worker_group_status, "has_preempted_worker", None)
    return bool(check()) if check is not None else False


def preemption_info(worker_group_status: Any) -> Any:
    """What Ray's poll says of a node being preempted (None: none is)."""
    getter = getattr(worker_group_status, "get_preemption_info", None)
    return getter() if getter is not None else None


class Recovery(ControllerCallback, WorkerGroupCallback, ReplicaGroupCallback):
    """Driver-side recovery for a Ray Train run; see the module docstring.

    ``health_check``: None, ``"gpu"`` (:func:`ray_goodput.driver._gpu_check.gpu_check`) or a
    function run on every candidate node before each attempt; raising or returning False
    excludes the node from that attempt and counts as one of its failures.
    ``storage_path``: where the Checkpointer writes, when not the Ray Train run directory.
    The checks start at the poll that sees a failure, beside Ray's shutdown of the old group.
    ``pg_shutdown_timeout_s``: how long a restart waits for the old group's
    ``destroy_process_group`` (Ray's ``TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S``, 30 s by
    default, which a hung NCCL teardown runs out); None leaves Ray's; an environment
    variable the user set wins.
    ``upload_wait_s``: how long a restart's resume choice waits for the saves the dead
    attempt's workers handed to their node uploaders and that are still uploading (they
    commit without their workers; the alternative is redoing the steps since the commit
    before); 0 does not wait. The wait runs beside the new group's start.
    """

    def __init__(
        self,
        *,
        health_check: Callable[[], object] | Literal["gpu"] | None = None,
        max_failures_per_node: int = 2,
        health_check_timeout_s: float = 120.0,
        storage_path: str | None = None,
        pg_shutdown_timeout_s: float | None = 5.0,
        upload_wait_s: float = UPLOAD_WAIT_S,
    ) -> None:
        if health_check == "gpu":
            health_check = _gpu_check.gpu_check
        if health_check is not None and not callable(health_check):
            raise ConfigError(f"health_check must be None, 'gpu' or a function, got {health_check!r}")
        if max_failures_per_node < 1:
            raise ConfigError(f"max_failures_per_node must be >= 1, got {max_failures_per_node}")
        if health_check_timeout_s <= 0:
            raise ConfigError(f"health_check_timeout_s must be > 0, got {health_check_timeout_s}")
        if pg_shutdown_timeout_s is not None and pg_shutdown_timeout_s < 1:
            raise ConfigError(f"pg_shutdown_timeout_s must be >= 1 or None, got {pg_shutdown_timeout_s}")
        if (
            isinstance(upload_wait_s, bool)
            or not isinstance(upload_wait_s, numbers.Real)
            or not 0 <= upload_wait_s < math.inf
        ):
            raise ConfigError(f"upload_wait_s must be a number of seconds >= 0, got {upload_wait_s}")
        self.health_check = health_check
        self.upload_wait_s = upload_wait_s
        self.health_check_timeout_s = health_check_timeout_s
        self.pg_shutdown_timeout_s = pg_shutdown_timeout_s
        self.storage_path = storage_path
        self.ledger = _placement.NodeLedger(max_failures_per_node)
        self.attempt = 0
        self.attempts: list[dict[str, Any]] = []
        self.stopped: dict[str, str] | None = None
        # Ray's failure budgets (FailureConfig field -> failures charged to it so far), so
        # that a second fit() of the run (replica mode's re-run) goes on from them.
        self.failures_charged: dict[str, int] = {MAX_FAILURES: 0, MAX_PREEMPTION_FAILURES: 0}
        self._root: StorageLocation | None = None
        self._rank_nodes: dict[int, str] = {}
        self._counted: set[str] = set()
        self._stop: BaseException | None = None
        self._unhealthy_short = 0  # starts in a row whose unhealthy nodes left too little room
        self._failure_seen = False  # polls showed errors that Ray has not decided on yet
        self._attempt_preempted = False  # a worker of this attempt (or replica) was preempted
        self._preemption_notice = False  # a poll said a node of this attempt is being preempted
        self._plain_errors = False  # a poll showed errors with no preempted worker among them
        self._scaling: Any = None  # the run's ScalingConfig, for checks started at a failure
        self._early_checks: dict[Any, str] | None = None  # started when the failure was seen
        self._early_busy: set[str] = set()  # nodes the failed group's workers ran on then
        self._choice: ResumeChoice | None = None  # made in the controller, with the root
        self._writer: StateWriter | None = None  # made in the controller, at the first record
        # Off in replica mode (the trainer says so): a replica's failure is replaced, not
        # restarted, and checks then would only load the survivors' nodes.
        self.checks_at_failure = True

    @property
    def isolated_nodes(self) -> list[str]:
        """Nodes that get no worker of this run again, in the order they were isolated."""
        return list(self.ledger.isolated)

    # -- controller hooks --
    def after_controller_start(self, train_run_context: Any) -> None:
        _log_where_ray_train_logs()
        _bound_process_group_shutdown(self.pg_shutdown_timeout_s)
        run_config = train_run_context.run_config
        self._root = resolve(self.storage_path) if self.storage_path else run_root(run_config.storage_context)
        self._choice = ResumeChoice(self._root, upload_wait_s=self.upload_wait_s)

    def on_controller_start_worker_group(self, *, scaling_config: Any, num_workers: int) -> dict[str, str] | None:
        self.attempt += 1
        self._counted = set()
        self._failure_seen = self._attempt_preempted = self._preemption_notice = self._plain_errors = False
        self._scaling = scaling_config
        if self.attempt > 1 and self._choice is not None:
            # Taken once the workers are up (after_worker_group_start), not waited for here:
            # placement needs the health checks only.
            self._choice.begin(self.attempt)
        unhealthy = self._check_health(scaling_config)
        excluded = sorted(set(self.ledger.isolated) | set(unhealthy))
        self.attempts.append(
            {
                "attempt": self.attempt,
                "t": time.time(),
                "resume_step": None,
                "excluded_nodes": excluded,
                "unhealthy": unhealthy,
            }
        )
        self._stop_if_no_healthy_room(scaling_config, unhealthy)
        self._warn_if_short(scaling_config, num_workers, excluded)
        self._save()
        return _placement.exclusion_selector(scaling_config, excluded)

    def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
        if self._failure_seen:  # one of Ray's decisions on a worker group's failure
            self._failure_seen = False
            preemption = self._attempt_preempted or (self._preemption_notice and not self._plain_errors)
            budget = MAX_PREEMPTION_FAILURES if preemption else MAX_FAILURES
            self.failures_charged[budget] = self.failures_charged.get(budget, 0) + 1
            self._save()
        if self._stop is None or getattr(failure_decision, "value", None) != "RETRY":
            return
        error, self._stop = self._stop, None
        logger.error(
            "attempt %d failed with %s, which a retry cannot fix: stopping the run now "
            "instead of retrying (FailureConfig.max_failures is not used). %s",
            self.attempt,
            type(error).__name__,
            error,
        )
        self._save(wait=True)
        raise error

    def after_controller_finish(self, result: Any) -> None:
        if self._choice is not None:
            self._choice.close()
        if self.ledger.isolated:
            logger.warning(
                "run ended after %d attempt(s); isolated nodes: %s", self.attempt, ", ".join(self.ledger.isolated)
            )
        self._save(wait=True)

    def before_controller_abort(self) -> None:
        """The run is aborted (Ctrl-C in the driver): the newest record is written before
        the controller goes."""
        if self._choice is not None:
            self._choice.close()
        if self._writer is not None:
            self._writer.flush(ABORT_WRITE_WAIT_S)

    # -- worker group hooks --
    def after_worker_group_start(self, worker_group: Any) -> None:
        workers = worker_group.get_workers()
        self._rank_nodes = {w.distributed_context.world_rank: w.metadata.node_id for w in workers}
        decision = None
        if self.attempt > 1 and self._choice is not None:
            decision = self._choice.take(self.attempt)
            self.attempts[-1]["resume_step"] = decision.step if decision else None
            self._save()
        # Before the training function starts: every rank of this attempt gets the same step,
        # and a restore that chooses for itself (no decision: a first attempt, or a choice
        # that failed or timed out) our bound on its wait for a dead attempt's uploads.
        worker_group.execute(set_decision, decision, self._upload_wait(), restart=self.attempt > 1)

    def after_replica_group_start(self, replica_group: Any) -> None:
        """Replica mode replaced a failed replica alone: its rank runs in a new process, maybe
        on another node, and a failure there is a new one to count."""
        for w in replica_group.get_workers():
            self._rank_nodes[w.distributed_context.world_rank] = w.metadata.node_id
        # Replica 0's replacement restores when no peer has progress: our bound on its wait.
        replica_group.execute(set_decision, None, self._upload_wait(), restart=True)
        self._counted = set()
        self._failure_seen = self._attempt_preempted = self._preemption_notice = self._plain_errors = False
        for ref in self._early_checks or {}:  # no group start follows to read them
            ray.cancel(ref, force=True)
        self._early_checks = None
        if self._choice is not None:
            self._choice.drop()

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        if preemption_info(worker_group_status) is not None:
            # A node is being preempted: Ray waits out its grace period and then decides on a
            # PreemptionError, whether or not any poll showed an error.
            self._failure_seen = self._preemption_notice = True
        errors = worker_group_status.errors
        if not errors:
            return
        self._start_checks_early()
        self._start_resume_choice_early()
        # While Ray waits out a preemption it polls again and again before its one failure
        # decision, and the survivors' errors are collateral (a collective aborted): the
        # failure is charged once, at the decision. Errors with no preempted worker among
        # them fail fast, charged as Ray's own worker-group failure. No node is charged
        # while a node of the attempt is being preempted: a worker's own failure cannot be
        # told from a side effect of the reclaim.
        if any(_preempted(e) for e in errors.values()) or _has_preempted_worker(worker_group_status):
            self._attempt_preempted = True
        else:
            self._plain_errors = True
        self._failure_seen = True
        for rank, exc in sorted(errors.items()):
            if not (self._attempt_preempted or self._preemption_notice):
                self._count_failure(rank, exc)
            hit = futile(exc)
            if hit is not None and self._stop is None:
                self._stop = hit
                self.stopped = stop_record(self.attempt, rank, hit)

    # -- helpers --
    def _upload_wait(self) -> tuple[str, float] | None:
        """``(root key, upload_wait_s)`` for ``set_decision``: how long a restore under our
        storage that chooses for itself waits for a dead attempt's uploads."""
        return (root_key(self._root), self.upload_wait_s) if self._root is not None else None

    def _count_failure(self, rank: int, exc: BaseException) -> None:
        node = self._rank_nodes.get(rank)
        if node is None or node in self._counted or _preempted(exc) or peers_failed(exc):
            return  # no node's fault: preempted, or a replica whose peers failed (PeerFailedError)
        self._counted.add(node)  # one failure per node per attempt, however many ranks
        if self.ledger.record(node, may_isolate=self._can_do_without):
            logger.warning(
                "node %s isolated after %d failures (last: rank %d, %s: %s); no worker "
                "of this run will be placed there again",
                node,
                self.ledger.failures[node],
                rank,
                type(exc).__name__,
                str(exc).splitlines()[0][:200] if str(exc) else "",
            )
            self._save()

    def _start_resume_choice_early(self) -> None:
        """At the poll that first sees this attempt's failure: begin the next attempt's
        resume choice (``_resume_choice``), while Ray decides, shuts the old group down and
        places the new one."""
        if self.checks_at_failure and self._choice is not None:
            self._choice.begin(self.attempt + 1)

    def _start_checks_early(self) -> None:
        """At the poll that first sees this attempt's failure: start the node checks now, so
        they run while Ray decides and shuts the old group down, not after."""
        if not self.checks_at_failure or self.health_check is None or self._scaling is None:
            return
        if self._early_checks is not None:
            return
        try:
            self._early_checks = _health.start_checks(
                self.health_check, _placement.candidate_nodes(self._scaling, self.ledger.isolated)
            )
            # Their workers still run (and hold their GPUs' memory) until Ray shuts the group
            # down: a failed check there is checked again at the start.
            self._early_busy = set(self._rank_nodes.values())
        except Exception as exc:  # noqa: BLE001 - the next start checks on its own
            logger.warning("could not start node health checks at the failure: %s", exc)

    def _check_health(self, scaling_config: Any) -> dict[str, str]:
        if self.health_check is None:
            return {}
        nodes = _placement.candidate_nodes(scaling_config, self.ledger.isolated)
        early, self._early_checks = self._early_checks or {}, None
        started = {ref: node for ref, node in early.items() if node in nodes}
        for ref, node in early.items():
            if node not in nodes:  # died or isolated meanwhile
                ray.cancel(ref, force=True)
        missing = [n for n in nodes if n not in started.values()]
        refs = {**started, **_health.start_checks(self.health_check, missing)}
        unhealthy = _health.collect(refs, self.health_check_timeout_s)
        # A node that failed its check at the failure while the old group's workers still ran
        # there (a GPU check's allocation meets their memory) is judged by a check now.
        again = sorted(n for n in unhealthy if n in self._early_busy and n in started.values())
        self._early_busy = set()
        if again:
            logger.info(
                "attempt %d: checking %s again: they failed while the failed group ran there", self.attempt, again
            )
            verdicts = _health.collect(_health.start_checks(self.health_check, again), self.health_check_timeout_s)
            for node in again:
                if node in verdicts:
                    unhealthy[node] = verdicts[node]
                else:
                    del unhealthy[node]
        for node, reason in sorted(unhealthy.items()):
            logger.warning(
                "attempt %d: node %s failed its health check (%s); no worker goes there this attempt",
                self.attempt,
                node,
                reason,
            )
            if self.ledger.record(node, may_isolate=self._can_do_without):
                logger.warning(
                    "node %s isolated after %d failures; no worker of this run will be placed there again",
                    node,
                    self.ledger.failures[node],
                )
        return unhealthy

    def _can_do_without(self, node: str) -> bool:
        """Whether the live nodes left once ``node`` is isolated still hold the smallest group
        the run starts. Isolating the last of them would leave Ray waiting for capacity for
        ever (it retries its placement timeout without limit); kept, the node's failures go
        on against ``FailureConfig.max_failures``, which ends the run."""
        if self._scaling is None:
            return True
        room = _placement.room(self._scaling, [*self.ledger.isolated, node])
        if room >= _placement.fewest_workers(self._scaling):
            return True
        logger.warning(
            "node %s failed %d times (max_failures_per_node) but is not isolated: without it the "
            "cluster holds %d of the %d workers the run needs; FailureConfig.max_failures bounds its retries",
            node,
            self.ledger.failures[node],
            room,
            _placement.fewest_workers(self._scaling),
        )
        return False

    def _stop_if_no_healthy_room(self, scaling_config: Any, unhealthy: dict[str, str]) -> None:
        """Nodes that failed their check leave too little room for the group: Ray would wait
        for capacity and retry the start for ever. At ``max_failures_per_node`` such starts
        in a row the start raises, naming the nodes and why (Ray ends the run with it)."""
        needed = _placement.fewest_workers(scaling_config)
        short = bool(unhealthy) and (
            _placement.room(scaling_config, sorted(set(self.ledger.isolated) | set(unhealthy)))
            < needed
            <= _placement.room(scaling_config, self.ledger.isolated)
        )
        self._unhealthy_short = self._unhealthy_short + 1 if short else 0
        if self._unhealthy_short >= self.ledger.max_failures:
            reasons = "; ".join(f"{node}: {why}" for node, why in sorted(unhealthy.items()))
            error = NoHealthyNodesError(
                f"the nodes that failed their health check left room for fewer than the {needed} "
                f"workers the run needs, at {self._unhealthy_short} starts in a row "
                f"(max_failures_per_node={self.ledger.max_failures}): {reasons}. Fix these nodes or "
                "the health check, or add nodes"
            )
            self._unhealthy_short = 0
            self.stopped = stop_record(self.attempt, None, error)
            self._save(wait=True)
            raise error

    def _warn_if_short(self, scaling_config: Any, num_workers: int, excluded: list[str]) -> None:
        if not excluded:
            return
        room = _placement.room(scaling_config, excluded)
        if room < num_workers:
            logger.warning(
                "attempt %d: without the excluded nodes (%s) the cluster has room for %d "
                "of %d workers; waiting for capacity as Ray does (autoscaler or new nodes)",
                self.attempt,
                ", ".join(excluded),
                room,
                num_workers,
            )

    def state(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "node_failures": dict(self.ledger.failures),
            "isolated_nodes": list(self.ledger.isolated),
            "stopped": self.stopped,
            "failures_charged": dict(self.failures_charged),
        }

    def _save(self, wait: bool = False) -> None:
        """Record the state now (written in the background; ``wait``: until written)."""
        if self._root is None:
            return
        if self._writer is None:
            self._writer = StateWriter(self._root)
        self._writer.put(json.dumps(self.state(), indent=1).encode())
        if wait:
            self._writer.flush(STATE_WRITE_WAIT_S)


def _bound_process_group_shutdown(timeout_s: float | None) -> None:
    """Bound the old group's process-group teardown at a restart (Ray waits up to
    ``TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S``, default 30 s, for ``destroy_process_group`` on
    the survivors, which hangs on NCCL when a peer died). Ray reads it in the controller at
    each shutdown, so it is set here, in the controller's process, unless the user set it."""
    if timeout_s is None or TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S in os.environ:
        return
    os.environ[TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S] = str(max(1, round(timeout_s)))


def _log_where_ray_train_logs() -> None:
    """In the controller, Ray Train configures only its own logger; without this our INFO
    lines (``attempt N resumes from step S``) would be dropped by the root logger."""
    ours, theirs = logging.getLogger("ray_goodput"), logging.getLogger("ray.train")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
