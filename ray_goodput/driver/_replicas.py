"""Driver side of replica mode: what the workers are told when they start or replace one,
and torchft's lighthouse started with the controller.

Ray's torchft backend creates the lighthouse (a new actor: a process, ``import ray``,
torchft) in ``on_start``, after the worker actors are up and their train context is
initialized, and waits for it there: seconds on the critical path of every run's start.
``ReplicaSupport`` starts it when the controller starts, so it comes up beside the worker
actors, and the backend of :class:`EarlyLighthouseConfig` takes that actor instead of
creating its own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import ray
import ray.train
from ray.train.v2._internal.execution.callback import ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback
from ray.train.v2.torch.torchft_config import (
    LighthouseServerActor,
    TorchftConfig,
    _TorchftBackend,  # no public way to hand it a lighthouse
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_goodput.errors import ConfigError
from ray_goodput.replica import ReplicaGroups
from ray_goodput.replica._config import require_torchft
from ray_goodput.runtime._join import WorkerJoin, set_join

logger = logging.getLogger(__name__)

#: How long a whole-group start waits for the lighthouse's address to learn whether it
#: died (only Ray's actor error says so; a slow answer is left to Ray's own wait).
_LIGHTHOUSE_ANSWER_S = 60.0

#: The lighthouse ReplicaSupport started in this (the controller's) process, until the
#: backend takes it. One run per controller process.
_started_lighthouse: Any = None


def start_lighthouse(lighthouse_kwargs: dict[str, Any]) -> Any:
    """Start torchft's lighthouse on this node without waiting for it; the backend of
    :class:`EarlyLighthouseConfig` in this process takes it. Returns its actor handle."""
    global _started_lighthouse  # noqa: PLW0603 - handed from the controller callback to the backend
    _started_lighthouse = _new_lighthouse(lighthouse_kwargs)
    return _started_lighthouse


def _new_lighthouse(lighthouse_kwargs: dict[str, Any]) -> Any:
    """A new lighthouse actor on this node (not waited for)."""
    return LighthouseServerActor.options(
        num_cpus=0,  # a coordinator: it must not wait for, or hold, a CPU the workers are placed on
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False),
    ).remote(lighthouse_kwargs={"bind": "[::]:0", **lighthouse_kwargs})


def _take_started_lighthouse() -> Any:
    global _started_lighthouse
    handle, _started_lighthouse = _started_lighthouse, None
    return handle


class EarlyLighthouseConfig(TorchftConfig):
    """Ray's ``TorchftConfig`` whose backend uses the lighthouse :func:`start_lighthouse`
    started (and Ray's own path, creating one in ``on_start``, when none was)."""

    @property
    def backend_cls(self) -> type:
        return _EarlyLighthouseBackend


class _EarlyLighthouseBackend(_TorchftBackend):
    def _maybe_create_lighthouse_actor(self, backend_config: Any) -> str:
        # Ray 2.60's backend reads the address of self.lighthouse_actor when it is set
        # (tests/test_replica_config.py holds it to that), and creates one when it is None.
        if self.lighthouse_actor is None:
            self.lighthouse_actor = _take_started_lighthouse()
        return super()._maybe_create_lighthouse_actor(backend_config)

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        if hasattr(worker_group, "get_replica_groups"):  # a whole group (a replacement's is a ReplicaGroup)
            self.replace_dead_lighthouse(backend_config.lighthouse_kwargs)
        super().on_start(worker_group, backend_config)

    def replace_dead_lighthouse(self, lighthouse_kwargs: dict[str, Any]) -> None:
        """Start a new lighthouse when the one this backend has died (its node lost,
        killed), so that a whole-group start uses it: Ray's backend asks the one it has at
        every start, and every restart would fail on the dead one. Started as
        :func:`start_lighthouse` starts one (no CPU: the workers' placement group may hold
        every CPU of the node). A replacement's start keeps Ray's way: its live peers know
        only the old address, so it fails, and the run starts again whole."""
        if self.lighthouse_actor is None:
            return
        try:
            ray.get(self.lighthouse_actor.address.remote(), timeout=_LIGHTHOUSE_ANSWER_S)
        except ray.exceptions.GetTimeoutError:
            return  # alive but slow: Ray's backend asks it again
        except ray.exceptions.RayActorError:
            logger.warning("torchft's lighthouse died; the worker group starts with a new one")
            self.lighthouse_actor = _new_lighthouse(lighthouse_kwargs)


class ReplicaSupport(ControllerCallback, WorkerGroupCallback, ReplicaGroupCallback):
    """Tells each worker how it joined (whole-group start, replacement, or a replacement
    whose peers finished) and the mode's settings, before its training function starts,
    and a replica still running when every peer has finished that it is to end; counts and
    logs replacements; starts the lighthouse with the controller
    (``lighthouse_kwargs``: its settings, None to leave it to Ray's backend). The goodput
    ledger, which no report refreshes in this mode, is the GoodputCallback's controller
    hooks' to refresh and publish.

    A worker-group callback (Ray passes only those to the worker group) that is also a
    replica-group callback (the hooks Ray 2.60 calls on a replacement) and a controller
    callback (the lighthouse). A replica that dies while Ray replaces another ends Ray's
    controller; ``ray_goodput.TorchTrainer.fit`` runs the job again (``replacement_raced``)."""

    def __init__(self, settings: ReplicaGroups, lighthouse_kwargs: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.lighthouse_kwargs = lighthouse_kwargs
        self.replacements: list[dict[str, Any]] = []
        self._ranks: set[int] = set()
        self._finished: set[int] = set()  # ranks whose training function returned
        # Replica groups still running: when every peer of one finishes first, it is told to
        # end. Replacements: one may still be waiting for a peer to heal from. With
        # min_replicas >= 2 the whole-group start's too: one the job's last quorums left out
        # waits for a quorum that cannot form. Else each waits out ReplicaGroups.timeout_s,
        # fails, and a finished run ends failed. (With min_replicas 1 such a replica forms a
        # quorum alone and ends the job itself, saving its last step when its peers did not.)
        self._running: list[tuple[set[int], Any]] = []
        self._told: list[Any] = []  # refs of those messages, dropped once delivered

    def _join(self, kind: str) -> WorkerJoin:
        return WorkerJoin(kind, dataclasses.asdict(self.settings))

    def after_controller_start(self, train_run_context: Any) -> None:
        if self.lighthouse_kwargs is not None:
            start_lighthouse(self.lighthouse_kwargs)

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._ranks = _ranks(worker_group)
        self._finished = set()
        groups = (worker_group.get_replica_groups() or []) if self.settings.min_replicas >= 2 else []
        self._running = [(_ranks(group), group) for group in groups]
        worker_group.execute(set_join, self._join("start"))

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        statuses = worker_group_status.worker_statuses
        self._finished |= {rank for rank, st in statuses.items() if not st.running and st.error is None}
        self._running = [(ranks, group) for ranks, group in self._running if not ranks <= self._finished]
        for ranks, group in [h for h in self._running if self._peers_finished(h[0])]:
            self._running.remove((ranks, group))
            if not group.is_active():  # shut down meanwhile: nobody left to tell
                continue
            # Fire and forget: the worker's actor thread is free while its training runs, and
            # the controller's poll must not wait on a worker.
            self._told.extend(group.execute_async(set_join, self._join("done")))
            logger.info("every peer of rank(s) %s finished: it is told to end", sorted(ranks))
        if self._told:
            _, self._told = ray.wait(self._told, num_returns=len(self._told), timeout=0)

    def before_replica_group_shutdown(self, replica_group: Any) -> None:
        self._running = [(r, g) for r, g in self._running if g is not replica_group]

    def _peers_finished(self, ranks: set[int]) -> bool:
        return bool(self._ranks - ranks) and self._ranks - ranks <= self._finished

    def after_replica_group_start(self, replica_group: Any) -> None:
        ranks = _ranks(replica_group)
        self._finished -= ranks
        self._running = [(r, g) for r, g in self._running if not r & ranks]
        done = self._peers_finished(ranks)
        replica_group.execute(set_join, self._join("done" if done else "replacement"))
        if not done:
            self._running.append((ranks, replica_group))
        self.replacements.append({"time": time.time(), "ranks": sorted(ranks), "peers_finished": done})
        logger.info(
            "replica group of rank(s) %s replaced; %s",
            sorted(ranks),
            "its peers had finished: it ends at once" if done else "the others kept running",
        )


def _ranks(group: Any) -> set[int]:
    return {w.distributed_context.world_rank for w in group.get_workers()}


def replica_kwargs(settings: ReplicaGroups, run_config: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(run_config, trainer kwargs)`` for replica mode: torchft's backend with this mode's
    lighthouse, and a failure budget for replacements when the user left Ray's default 0.
    Raises ConfigError for what replica mode cannot run, naming the fix."""
    if not isinstance(settings, ReplicaGroups):
        raise ConfigError(f"fault_tolerance must be a ray_goodput.ReplicaGroups or None, got {settings!r}")
    require_torchft()
    if kwargs.get("datasets"):
        raise ConfigError(
            "replica mode does not take Ray Data datasets=: a replacement would get the whole "
            "dataset; pass a map-style dataset to ray_goodput.replica.Replica instead"
        )
    given = kwargs.get("torch_config")
    if given is not None and not isinstance(given, TorchftConfig):
        raise ConfigError("replica mode sets torch_config (torchft's); drop torch_config= or pass a TorchftConfig")
    scaling = kwargs.get("scaling_config")
    if scaling is not None and getattr(scaling, "use_gpu", False):
        raise ConfigError("replica mode runs on CPU with gloo in this release; set ScalingConfig(use_gpu=False)")
    out = dict(kwargs)
    out["torch_config"] = given or EarlyLighthouseConfig(lighthouse_kwargs=settings.lighthouse_kwargs(), backend="gloo")
    failure = run_config.failure_config or ray.train.FailureConfig()
    if failure.max_failures == 0:  # Ray's default: the first replacement would end the run
        failure = dataclasses.replace(failure, max_failures=settings.max_failures)
    return dataclasses.replace(run_config, failure_config=failure), out
