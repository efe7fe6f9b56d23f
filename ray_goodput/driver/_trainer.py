"""``ray_goodput.TorchTrainer``: Ray's TorchTrainer plus ``callbacks=``, ``recovery=`` and
``fault_tolerance=``.

A subclass, not a wrapper: it stays a ``ray.train.torch.TorchTrainer`` for every isinstance
check, every argument and method keeps Ray's meaning and documentation, and the only thing
it changes is what ends up in ``RunConfig.callbacks`` (Ray 2.60 takes callbacks only there)
and, in replica mode, the torch backend and the default failure budget.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import ray.train
import ray.train.torch
from ray.exceptions import RayActorError
from ray.train.v2.api.callback import RayTrainCallback
from ray.train.v2.api.exceptions import ControllerError

from ray_goodput.driver._callback import GoodputCallback, GoodputControllerHooks
from ray_goodput.driver._node_services import NodeServices
from ray_goodput.driver._record import load_state
from ray_goodput.driver._recovery import MAX_FAILURES, MAX_PREEMPTION_FAILURES, Recovery
from ray_goodput.driver._replicas import EarlyLighthouseConfig, ReplicaSupport, replica_kwargs
from ray_goodput.errors import ConfigError
from ray_goodput.replica import ReplicaGroups
from ray_goodput.runtime import run_root
from ray_goodput.storage import resolve

logger = logging.getLogger(__name__)

_DEFAULT_RECOVERY: Any = object()  # "a fresh Recovery()", told apart from an explicit None


class TorchTrainer(ray.train.torch.TorchTrainer):
    """Ray's ``TorchTrainer`` with three more keyword arguments.

    ``callbacks``: Ray Train callbacks (e.g. ``GoodputCallback()``), appended to
    ``RunConfig.callbacks``. ``recovery``: a :class:`Recovery` (default ``Recovery()``, or the
    one already in the callbacks); ``None`` turns driver-side recovery off. After ``fit``,
    ``self.recovery`` holds what the controller's copy recorded (``isolated_nodes``...).
    ``fault_tolerance``: ``ReplicaGroups(...)`` for replica mode (each worker a replica
    group that is replaced alone when it fails; the training function uses
    ``ray_goodput.replica.Replica``), or None (a failure restarts the whole group).
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        callbacks: Sequence[RayTrainCallback] | None = None,
        recovery: Recovery | None = _DEFAULT_RECOVERY,
        run_config: ray.train.RunConfig | None = None,
        fault_tolerance: ReplicaGroups | None = None,
        **kwargs: Any,
    ) -> None:
        run_config = run_config or ray.train.RunConfig()
        self._fault_tolerance = fault_tolerance
        self.fit_reruns = 0  # replica mode: how often the last fit() ran Ray's fit again
        merged = list(run_config.callbacks or []) + list(callbacks or [])
        self.recovery = _pick_recovery(merged, recovery)
        # Before the callbacks added below: at the run's end its record is written before the
        # goodput hooks' summary reads it.
        if self.recovery is not None and not any(c is self.recovery for c in merged):
            merged.append(self.recovery)
        if fault_tolerance is not None:
            run_config, kwargs = replica_kwargs(fault_tolerance, run_config, kwargs)
            ours = isinstance(kwargs["torch_config"], EarlyLighthouseConfig)  # not a TorchftConfig the user gave
            lighthouse = kwargs["torch_config"].lighthouse_kwargs if ours else None
            merged.append(ReplicaSupport(fault_tolerance, lighthouse_kwargs=lighthouse))
            if self.recovery is not None:
                self.recovery.checks_at_failure = False  # a replica's failure is no restart
        for goodput in [c for c in merged if isinstance(c, GoodputCallback)]:
            if not any(isinstance(c, GoodputControllerHooks) and c.goodput is goodput for c in merged):
                merged.append(goodput.controller_callback())  # MLflow opened early, no report waits on it
        if not any(isinstance(c, NodeServices) for c in merged):
            # Node uploaders up before the first save, in the workers' runtime env.
            merged.append(NodeServices(run_config.worker_runtime_env))
        super().__init__(train_loop_per_worker, run_config=dataclasses.replace(run_config, callbacks=merged), **kwargs)

    def fit(self) -> ray.train.Result:
        """Ray's ``fit``; afterwards ``self.recovery`` shows what happened, even on failure.

        In replica mode, a run that Ray's controller ended because a worker died while it
        was replacing another replica (see :func:`replacement_raced`) is run again, at most
        ``ReplicaGroups.max_failures`` times: it resumes from the durable checkpoint, as a
        whole-group restart would have, and ``Recovery`` goes on from the run's record (its
        attempts, node failures and isolated nodes). Ray's failure budgets go on too: a
        re-run gets ``FailureConfig.max_failures`` (and ``max_preemption_failures``) less
        the failures the runs before it used, the dead worker that ended the last one
        included, and is not made when none is left. ``self.fit_reruns`` counts the re-runs."""
        self.fit_reruns = 0
        given = self.run_config
        limits = given.failure_config or ray.train.FailureConfig()
        charged = {MAX_FAILURES: 0}  # without a Recovery: the failures that ended runs
        try:
            while True:
                try:
                    return super().fit()
                except ControllerError as exc:
                    budget = self._fault_tolerance.max_failures if self._fault_tolerance is not None else 0
                    if self.fit_reruns >= budget or not replacement_raced(exc):
                        raise
                    # The next controller gets this record through the Recovery it is sent,
                    # so its attempts, node failures, isolated nodes and charged failures go
                    # on from here.
                    self._refresh_recovery()
                    if self.recovery is not None:
                        charged = self.recovery.failures_charged
                    charged[MAX_FAILURES] = charged.get(MAX_FAILURES, 0) + 1  # the worker that ended it
                    failure_config = rerun_failure_config(limits, charged)
                    if failure_config is None:
                        logger.error(
                            "Ray's controller ended the run when a worker died while it replaced a "
                            "failed replica; not running fit() again: the run has spent its failure "
                            "budget (FailureConfig max_failures=%d, max_preemption_failures=%d; "
                            "charged: %s).",
                            limits.max_failures,
                            limits.max_preemption_failures,
                            charged,
                        )
                        raise
                    self.fit_reruns += 1
                    self.run_config = dataclasses.replace(given, failure_config=failure_config)
                    logger.warning(
                        "Ray's controller ended the run: a worker died while it replaced a failed "
                        "replica (%s). Running fit() again from the durable checkpoint (%d of at most "
                        "%d), with max_failures=%d left.",
                        exc.controller_failure,
                        self.fit_reruns,
                        budget,
                        failure_config.max_failures,
                    )
        finally:
            self.run_config = given
            self._refresh_recovery()

    def _refresh_recovery(self) -> None:
        if self.recovery is None:
            return
        root = (
            resolve(self.recovery.storage_path)
            if self.recovery.storage_path
            else run_root(self.run_config.storage_context)
        )
        try:
            state = load_state(root)
            if state is None:
                return
            attempts = list(state["attempts"])
            failures, isolated = dict(state["node_failures"]), list(state["isolated_nodes"])
            stopped = state["stopped"]
            charged = dict(state.get("failures_charged", self.recovery.failures_charged))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Called from fit()'s finally: never raised over the run's own result or error.
            logger.warning("could not read the recovery record under %s: %s", root.uri, exc)
            return
        self.recovery.attempts, self.recovery.attempt = attempts, len(attempts)
        self.recovery.ledger.failures, self.recovery.ledger.isolated = failures, isolated
        self.recovery.stopped, self.recovery.failures_charged = stopped, charged


def rerun_failure_config(config: ray.train.FailureConfig, charged: dict[str, int]) -> ray.train.FailureConfig | None:
    """``config`` for a re-run of ``fit``: each of Ray's failure budgets (``max_failures``,
    ``max_preemption_failures``; -1 is unlimited) less the failures ``charged`` to it by the
    runs before, or None when one of them is overspent (Ray would have raised there)."""
    left = {}
    for field in (MAX_FAILURES, MAX_PREEMPTION_FAILURES):
        limit = getattr(config, field)
        if limit == -1:
            continue
        left[field] = limit - charged.get(field, 0)
        if left[field] < 0:
            return None
    return dataclasses.replace(config, **left)


def replacement_raced(exc: ControllerError) -> bool:
    """Whether Ray's controller ended the run on a worker that died under one of its own
    calls (a ``RayActorError`` as the controller's failure): in replica mode, a replica that
    died after the poll that saw another one fail, and before Ray, replacing that one,
    called it (Ray 2.60 waits on every other replica there, the dead included, and does
    not retry the error). Nothing durable is lost: the next run resumes from the newest
    committed checkpoint."""
    return isinstance(exc.controller_failure, RayActorError)


def _pick_recovery(callbacks: list[Any], recovery: Any) -> Recovery | None:
    present = [c for c in callbacks if isinstance(c, Recovery)]
    if len(present) > 1:
        raise ConfigError("more than one Recovery among the callbacks; keep one")
    if recovery is _DEFAULT_RECOVERY:
        return present[0] if present else Recovery()
    if recovery is not None and not isinstance(recovery, Recovery):
        raise ConfigError(f"recovery must be a ray_goodput.Recovery or None, got {recovery!r}")
    if present and recovery is None:
        raise ConfigError("recovery=None turns recovery off, but a Recovery is in the callbacks; remove one of the two")
    if present and recovery is not present[0]:
        raise ConfigError("a Recovery is in the callbacks and another was passed as recovery=; pass it once")
    return recovery
