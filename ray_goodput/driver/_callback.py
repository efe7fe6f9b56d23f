"""GoodputCallback: one goodput ledger per job, across all worker-group restarts."""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from typing import Any

from ray.train import Checkpoint, UserCallback
from ray.train.v2._internal.execution.callback import ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback

from ray_goodput.driver._publish import MlflowSink, RayGauges
from ray_goodput.driver._record import load_state
from ray_goodput.driver._recovery import futile, preemption_info, stop_record
from ray_goodput.errors import StorageError
from ray_goodput.goodput import EventReader, Ledger, compute, fetch_stats, summary, table
from ray_goodput.runtime import run_root
from ray_goodput.storage import StorageLocation, read_bytes, write_bytes

logger = logging.getLogger(__name__)

#: How long the controller's end waits for the MLflow thread to finish the run.
_MLFLOW_DRAIN_S = 120.0
_MLFLOW_RUN_FILE = "goodput/mlflow_run.json"  # the job's MLflow run, for a fit() run again
#: How long the run's end (or a stop) waits for a refresh already reading the events.
_REFRESH_WAIT_S = 60.0
#: The share of the controller's time the refreshes between reports may take: the ledger is
#: recomputed over every event of the run (about 0.9 s per million steps), so a long run's
#: refreshes come further apart than ``log_every_s``.
_REFRESH_SHARE = 0.05


class GoodputCallback(UserCallback):
    """Splits the job's wall time into goodput and badput causes and publishes it.

    Use as ``RunConfig(callbacks=[GoodputCallback()])``. Runs in the Ray Train controller.
    Workers feed it through ``Checkpointer``, ``ray_goodput.data.DataLoader`` and
    ``ray_goodput.record_step``. One MLflow run per job (``tracking_uri`` default: a sqlite
    file ``mlflow.db`` in the driver's working directory), left open across restarts and
    finished with a chart, a timeline and a summary when the training function ends
    cleanly (with the controller hooks, at the controller's end, so the final ledger spans
    all of ``fit()``; without them, at the report that sees the end);
    ``<run dir>/goodput/summary.json`` too (with the nodes a Recovery isolated).
    While it runs: ledger metrics and the data wait per step (``data/fetch_seconds_p50``,
    ``_p95``, ``_max`` per logging interval) go to MLflow, live values to Ray metrics, at
    each report and, with the controller hooks below, every ``log_every_s`` between reports
    (replica mode never reports).

    MLflow calls run in one background thread of the controller at the lowest CPU priority.
    With its :meth:`controller_callback` in the run too (``ray_goodput.TorchTrainer`` adds
    it), the MLflow run is opened when the controller starts (importing MLflow and creating
    a sqlite store take seconds), no report waits on MLflow, and the controller's end waits
    for the thread to finish the run (at most 120 s). Without it (Ray's own TorchTrainer
    with only this callback: Ray calls a ``UserCallback`` at reports and exceptions only),
    the report that makes the ledger final waits for MLflow to finish the run.
    """

    def __init__(
        self, *, tracking_uri: str | None = None, experiment_name: str = "ray_goodput", log_every_s: float = 5.0
    ) -> None:
        self.tracking_uri = tracking_uri or f"sqlite:///{os.path.abspath('mlflow.db')}"
        self.experiment_name = experiment_name
        self.log_every_s = log_every_s
        self.job_start = time.time()  # constructed in the driver, right before fit()
        self.ledger: Ledger | None = None
        self._failures: list[str] = []
        self._failure_open = False  # a failure is counted and no group has started since
        self._hooked = False  # its controller hooks say when a group starts (else: one per poll)
        self._state: dict[str, Any] = {}
        # This job's: every fit() of this callback (its controllers get copies) goes on in
        # one MLflow run; another driver's callback on the same storage opens its own.
        self._job = uuid.uuid4().hex

    @property
    def run_context(self) -> Any:
        """Ray Train's run context, once the controller hooks saw the controller start."""
        return self._state.get("run_context")

    def controller_callback(self) -> ControllerCallback:
        """A Ray Train controller callback for this GoodputCallback: pass both in the run's
        callbacks (``ray_goodput.TorchTrainer`` adds it itself)."""
        self._hooked = True
        return GoodputControllerHooks(self)

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_state"] = {}  # threads and clients are rebuilt in the controller
        return d

    # -- plumbing (lazily, in the controller process) --
    def _root(self, run_context: Any) -> StorageLocation:
        if "root" not in self._state:
            cfg = run_context.get_run_config()
            self._state["root"] = run_root(cfg.storage_context)
            self._state["name"] = cfg.name
            self._state["reader"] = EventReader(self._state["root"])
        return self._state["root"]

    def _worker(self) -> queue.Queue:
        """MLflow calls go through one background thread: the controller never waits on them."""
        if "queue" not in self._state:
            q: queue.Queue = queue.Queue()
            self._state["queue"] = q
            threading.Thread(target=self._drain, args=(q,), name="rg-goodput-mlflow", daemon=True).start()
        return self._state["queue"]

    def _lock(self) -> threading.RLock:
        """Held while the ledger is refreshed and published: the controller's hooks and
        the periodic refresh (a thread) take turns."""
        return self._state.setdefault("lock", threading.RLock())

    def _drain(self, q: queue.Queue) -> None:
        _lowest_cpu_priority()
        sink = None
        while True:
            kind, payload, done = q.get()
            try:
                if sink is None and kind in ("fail", "flush"):
                    continue  # no run is open (every open failed): none is made to fail it or to wait
                if sink is None:
                    sink = self._open_sink()
                getattr(sink, kind)(*payload)
            except Exception as exc:  # noqa: BLE001 - accounting must never break training
                logger.warning("goodput MLflow %s failed: %s", kind, exc)
            finally:
                if done is not None:
                    done.set()

    def _open_sink(self) -> MlflowSink:
        """The job's MLflow run: the one an earlier ``fit()`` of this job (this callback's)
        opened in this store and experiment (its id is kept under the run's storage root),
        else a new one."""
        root = self._state.get("root")
        key = {"tracking_uri": self.tracking_uri, "experiment": self.experiment_name, "job": self._job}
        earlier = None
        if root is not None:
            try:
                kept = json.loads(read_bytes(root, _MLFLOW_RUN_FILE))
            except FileNotFoundError:
                kept = None
            except (StorageError, ValueError) as exc:
                logger.warning("could not read the job's MLflow run id (%s); a new run is opened", exc)
                kept = None
            if isinstance(kept, dict) and isinstance(kept.get("run_id"), str):
                earlier = kept["run_id"] if {k: kept.get(k) for k in key} == key else None
            elif kept is not None:
                logger.warning("%s under %s is not a run record; a new run is opened", _MLFLOW_RUN_FILE, root.uri)
        sink = MlflowSink(self.tracking_uri, self.experiment_name, self._state.get("name", "run"), resume=earlier)
        self._state["mlflow_run_id"] = sink.run_id
        if root is not None and sink.run_id != earlier:
            try:
                write_bytes(root, _MLFLOW_RUN_FILE, json.dumps({**key, "run_id": sink.run_id}).encode())
            except StorageError as exc:
                logger.warning("could not keep the job's MLflow run id: a fit() run again opens another run (%s)", exc)
        return sink

    # -- the ledger --
    def refresh(self, run_context: Any, job_end: float | None = None) -> Ledger:
        """Recompute the ledger from the workers' events (reads only the new ones);
        ``job_end``: the run's end when later than its last event (its tail counts)."""
        self._root(run_context)
        events = self._state["reader"].poll()
        self._state["attempts"] = sorted((a for a in events.values() if a), key=lambda a: a[0]["t"])
        self.ledger = compute(self._state["attempts"], job_start=self.job_start, job_end=job_end)
        self.ledger.failures = max(self.ledger.failures, len(self._failures))
        return self.ledger

    def _wait_for_mlflow(self, timeout_s: float) -> bool:
        """Whether every MLflow call queued so far has run (waits at most ``timeout_s``)."""
        if "queue" not in self._state:
            return True
        done = threading.Event()
        self._state["queue"].put(("flush", (), done))
        return done.wait(timeout=timeout_s)

    def _publish(self, run_context: Any, ledger: Ledger, final: bool) -> None:
        step = int(time.time() - self.job_start)
        if "gauges" not in self._state:
            self._state["gauges"] = _safe_gauges(self._state.get("name", "run"))
        gauges = self._state["gauges"]
        if gauges is not None:
            gauges.set(ledger)
        if final:
            self._finish(run_context, ledger, step)
        elif time.time() - self._state.get("last_log", 0.0) >= self.log_every_s:
            since, self._state["last_log"] = self._state.get("last_log", 0.0), time.time()
            latest = self._state["attempts"][-1] if self._state["attempts"] else []
            self._worker().put(("log", ({**ledger.as_metrics(), **fetch_stats(latest, since)}, step), None))

    def _finish(self, run_context: Any, ledger: Ledger, step: int) -> None:
        """The final publication; it returns once MLflow finished the run (bounded)."""
        root = self._root(run_context)
        recovery = _recovery_state(root)
        isolated = recovery.get("isolated_nodes", [])
        notes = attempt_notes(recovery.get("attempts", []), self._state["attempts"])
        result = {**summary(ledger), "isolated_nodes": isolated, "stopped": _stopped(recovery, self._state.get("stop"))}
        if isolated:
            self._worker().put(("tag", ("ray_goodput.isolated_nodes", ",".join(isolated)), None))
        self._worker().put(("finish", (ledger, step, result, self._state["attempts"], notes), None))
        write_bytes(root, "goodput/summary.json", json.dumps(result, indent=1).encode())
        if not self._state.get("drained_at_end"):  # else the controller's end waits, once, for all of it
            self._wait_for_mlflow(_MLFLOW_DRAIN_S)
        logger.info(
            "goodput of the job:\n%s%s", table(ledger), f"\nisolated nodes: {', '.join(isolated)}" if isolated else ""
        )

    # -- the controller's start and end (GoodputControllerHooks) --
    def controller_started(self, train_run_context: Any) -> None:
        """Open the MLflow run now, in the background (ready before the first report), and
        leave the wait for MLflow to the controller's end."""
        self._state["drained_at_end"] = True
        self._state["run_context"] = train_run_context
        try:
            self._root(train_run_context)
            self._worker().put(("open", (), None))
        except Exception as exc:  # noqa: BLE001 - never fail the run over accounting
            logger.warning("goodput MLflow run not opened at the start: %s", exc)

    def controller_finished(self, result: Any = None) -> None:
        """The controller's process ends after this. The final ledger is published now, up
        to this moment, unless the run ended with an error (``result.error``); then the
        MLflow run ends FAILED (a ``fit()`` run again for the job resumes it). A run whose
        training function recorded no end (replica 0 replaced after its peers finished, or
        no ``Checkpointer``) is published too: its summary says ``finished: false``."""
        deadline = time.monotonic() + _MLFLOW_DRAIN_S  # for the publication and MLflow together
        ctx = self.run_context
        if ctx is not None and getattr(result, "error", None) is None:
            self._publish_final(ctx)
        elif getattr(result, "error", None) is not None and "queue" in self._state and not self._state.get("finished"):
            self._worker().put(("fail", (), None))  # not left RUNNING (a fit() run again resumes it)
        if not self._wait_for_mlflow(max(0.0, deadline - time.monotonic())):
            logger.warning("goodput MLflow calls still running after %.0f s; the run may stay open", _MLFLOW_DRAIN_S)

    # -- Ray Train hooks --
    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        if not self._lock().acquire(blocking=False):
            # The controller hooks' refresh (a thread at the lowest CPU priority) is reading
            # the events: every worker waits in this report, so it does not wait for that.
            # The next report, or the controller's end, reads what this one skips.
            return
        try:
            ledger = self.refresh(run_context)
            # With the controller hooks, the controller's end publishes the final ledger: it
            # spans all of fit() (the last commit's report, the workers' shutdown) and every
            # event. Without them, this report is the last chance.
            final = ledger.finished and not self._state.get("finished") and not self._state.get("drained_at_end")
            self._publish(run_context, ledger, final)
            if final:
                self._state["finished"] = True
        except Exception as exc:  # noqa: BLE001 - never fail the run over accounting
            logger.warning("goodput ledger update failed: %s", exc)
        finally:
            self._lock().release()

    def publish_progress(self, run_context: Any) -> None:
        """Refresh the ledger and publish it as it stands (never as final), at most every
        ``log_every_s``. The controller hooks call it from a thread between reports: the
        events read then are not read again by the next report, or by the run's end."""
        _lowest_cpu_priority()
        if not self._lock().acquire(blocking=False):
            return  # a report or the run's end is publishing
        try:
            ledger = self.refresh(run_context)
            if ledger.attempts and not self._state.get("finished"):  # nothing recorded yet: nothing to show
                self._publish(run_context, ledger, final=False)
        except Exception as exc:  # noqa: BLE001 - never fail the run over accounting
            logger.warning("goodput ledger update failed: %s", exc)
        finally:
            self._lock().release()

    def _publish_final(self, run_context: Any) -> None:
        """Publish the job's ledger as final, once, up to now: the run's end, not its last
        step (a replacement still starting, or the last upload, is time the job took)."""
        end = time.time()
        if not self._lock().acquire(timeout=_REFRESH_WAIT_S):
            logger.warning("goodput ledger not published: a refresh has held it %.0f s", _REFRESH_WAIT_S)
            return
        try:
            if self._state.get("finished"):
                return
            self._publish(run_context, self.refresh(run_context, job_end=end), final=True)
            self._state["finished"] = True
        except Exception as exc:  # noqa: BLE001 - never fail the run over accounting
            logger.warning("goodput ledger update failed: %s", exc)
        finally:
            self._lock().release()

    def failed(self, what: str) -> None:
        """A worker group failed (or a node of it is being preempted): one failure, however
        many ranks and however many polls show it (Ray polls a preempted group for its
        grace period before it decides); a new one once a group or a replica's replacement
        started since (``group_started``; without the controller hooks, each poll with
        errors counts)."""
        if not self._failure_open:
            self._failure_open = self._hooked
            self._failures.append(what)
            self._worker().put(("log_failure", (len(self._failures), what), None))

    def group_started(self) -> None:
        """A worker group, or a replica's replacement, started: the next error is a new failure."""
        self._failure_open = False

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self._root(run_context)  # names the MLflow run before its first entry
        texts = {rank: f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in worker_exceptions.items()}
        self.failed("; ".join(texts.values()))
        hits = [(rank, hit) for rank, exc in sorted(worker_exceptions.items()) if (hit := futile(exc)) is not None]
        if hits and not self._state.get("finished"):
            # A Recovery ends the run here; without one, every retry fails the same way.
            # Either way this is the job's last useful ledger: publish it as final. Ray
            # calls this before the Recovery's hook of the same poll: the stop it is about
            # to make is told here, as it records it (the lowest rank's error).
            rank, hit = hits[0]
            logger.error(
                "NOT RETRYABLE (a restart will fail the same way; fix the cause and start a new run): %s", texts[rank]
            )
            self._worker().put(("tag", ("ray_goodput.stopped_by", texts[rank]), None))
            self._state["stop"] = (rank, hit)
            self._publish_final(run_context)


class GoodputControllerHooks(ControllerCallback, WorkerGroupCallback, ReplicaGroupCallback):
    """The controller's start and end for a :class:`GoodputCallback` (Ray Train calls a
    ``UserCallback`` at reports and exceptions only), and a refresh of its ledger every
    ``log_every_s`` between them, in a thread started from the controller's poll of the
    workers (further apart when a refresh takes more than a twentieth of that). Made by
    :meth:`GoodputCallback.controller_callback`."""

    def __init__(self, goodput: GoodputCallback) -> None:
        self.goodput = goodput
        self._refresher: threading.Thread | None = None
        self._next_refresh = 0.0  # time.monotonic() of the next one
        self._preemption: str | None = None  # a poll's notice of a node being preempted

    def after_controller_start(self, train_run_context: Any) -> None:
        self.goodput.controller_started(train_run_context)

    def on_controller_start_worker_group(self, *, scaling_config: Any, num_workers: int) -> None:
        self._preemption = None
        self.goodput.group_started()

    def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
        """A preemption Ray decided on is a failure, also when no poll showed an error."""
        preemption, self._preemption = self._preemption, None
        if preemption is not None and self.goodput.run_context is not None:
            self.goodput.failed(preemption)

    def after_replica_group_start(self, replica_group: Any) -> None:
        self._preemption = None
        self.goodput.group_started()

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        info = preemption_info(worker_group_status)
        if info is not None:  # counted at Ray's decision: the group may finish within its grace
            self._preemption = f"a node of the worker group was preempted: {info}"
        ctx = self.goodput.run_context
        now = time.monotonic()
        if ctx is None or now < self._next_refresh or (self._refresher is not None and self._refresher.is_alive()):
            return
        self._next_refresh = now + self.goodput.log_every_s
        self._refresher = threading.Thread(target=self._refresh, args=(ctx,), name="rg-goodput-refresh", daemon=True)
        try:
            self._refresher.start()
        except RuntimeError as exc:  # no thread to be had: never fail the run over accounting
            self._refresher = None
            logger.warning("goodput ledger refresh not started: %s", exc)

    def _refresh(self, ctx: Any) -> None:
        start = time.monotonic()
        try:
            self.goodput.publish_progress(ctx)
        finally:
            took = time.monotonic() - start
            self._next_refresh = max(self._next_refresh, time.monotonic() + took / _REFRESH_SHARE)

    def after_controller_finish(self, result: Any) -> None:
        self.goodput.controller_finished(result)


def _lowest_cpu_priority() -> None:
    """This thread at niceness 19 (Linux: a thread is a task), so accounting never takes a
    core from training processes on the same node."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError as exc:
        logger.debug("could not lower the MLflow thread's priority: %s", exc)


def attempt_notes(recovery_attempts: list[dict[str, Any]], rows: list[list[dict[str, Any]]]) -> dict[int, str]:
    """The timeline's note of the nodes excluded from each attempt, by row. Rows are rank
    0's processes (a replica's replacement has its own; an attempt whose rank 0 died before
    its first event has none), so an attempt's note goes to the first row that began after
    the attempt started and before the next one did; none when its record has no time."""
    notes: dict[int, str] = {}
    starts = [a.get("t") for a in recovery_attempts]
    for i, a in enumerate(recovery_attempts):
        if not a.get("excluded_nodes") or starts[i] is None:
            continue
        until = next((t for t in starts[i + 1 :] if t is not None), float("inf"))
        row = next((r for r, events in enumerate(rows) if events and starts[i] <= events[0]["t"] < until), None)
        if row is not None:
            notes[row] = "excluded " + ", ".join(n[:8] for n in a["excluded_nodes"])
    return notes


def _stopped(recovery: dict[str, Any], stop: tuple[int, BaseException] | None) -> dict[str, str] | None:
    """Why the run was stopped: what the Recovery recorded, or the stop it is about to make
    for an error a retry cannot fix (``stop``: rank and error, seen first: see
    ``after_exception``). None without a Recovery (no record): Ray then retries up to
    ``max_failures``."""
    if recovery.get("stopped") or not recovery or stop is None:
        return recovery.get("stopped")
    attempts = recovery.get("attempts") or [{}]
    return stop_record(attempts[-1].get("attempt", ""), *stop)


def _recovery_state(root: StorageLocation) -> dict[str, Any]:
    """What a Recovery recorded for this run ({} without one, or when unreadable)."""
    try:
        return load_state(root) or {}
    except Exception as exc:  # noqa: BLE001 - the summary goes out without it
        logger.warning("could not read the recovery record under %s: %s", root.uri, exc)
        return {}


def _safe_gauges(run_name: str) -> RayGauges | None:
    try:
        return RayGauges(run_name)
    except Exception as exc:  # noqa: BLE001 - metrics are optional
        logger.debug("Ray metrics unavailable: %s", exc)
        return None
