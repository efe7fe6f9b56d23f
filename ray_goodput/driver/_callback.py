"""GoodputCallback: one goodput ledger per job, across all worker-group restarts."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from typing import Any

from ray.train import Checkpoint, UserCallback

from ray_goodput.driver._publish import MlflowSink, RayGauges
from ray_goodput.errors import not_retryable
from ray_goodput.goodput import Ledger, compute, read_events, summary, table
from ray_goodput.storage import StorageLocation, write_bytes

logger = logging.getLogger(__name__)



class GoodputCallback(UserCallback):
    """Splits the job's wall time into goodput and badput causes and publishes it.

    Use as ``RunConfig(callbacks=[GoodputCallback()])``. Runs in the Ray Train controller.
    Workers feed it through ``Checkpointer``, ``ray_goodput.data.DataLoader`` and
    ``ray_goodput.record_step``. One MLflow run per job (``tracking_uri`` default: a sqlite
    file ``mlflow.db`` in the driver's working directory), left open across restarts and
    finished with a chart and a summary when the training function ends cleanly;
    ``<run dir>/goodput/summary.json`` too. Live values go to Ray metrics.
    """

    def __init__(self, *, tracking_uri: str | None = None, experiment_name: str = "ray_goodput",
                 log_every_s: float = 5.0) -> None:
        self.tracking_uri = tracking_uri or f"sqlite:///{os.path.abspath('mlflow.db')}"
        self.experiment_name = experiment_name
        self.log_every_s = log_every_s
        self.job_start = time.time()  # constructed in the driver, right before fit()
        self.ledger: Ledger | None = None
        self._failures: list[str] = []
        self._state: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_state"] = {}  # threads and clients are rebuilt in the controller
        return d

    # -- plumbing (lazily, in the controller process) --
    def _root(self, run_context: Any) -> StorageLocation:
        if "root" not in self._state:
            from ray.train.v2._internal.execution.storage import StorageContext  # noqa: PLC0415

            cfg = run_context.get_run_config()
            storage = StorageContext(cfg.storage_path, cfg.name, cfg.storage_filesystem, read_only=True)
            path = storage.experiment_fs_path
            self._state["root"] = StorageLocation(uri=path, fs=storage.storage_filesystem, root=path)
            self._state["name"] = cfg.name
        return self._state["root"]

    def _worker(self) -> queue.Queue:
        """MLflow calls go through one background thread: the controller never waits on them."""
        if "queue" not in self._state:
            q: queue.Queue = queue.Queue()
            self._state["queue"] = q
            threading.Thread(target=self._drain, args=(q,), name="rg-goodput-mlflow", daemon=True).start()
        return self._state["queue"]

    def _drain(self, q: queue.Queue) -> None:
        sink = None
        while True:
            kind, payload, done = q.get()
            try:
                if sink is None:
                    sink = MlflowSink(self.tracking_uri, self.experiment_name, self._state.get("name", "run"))
                    self._state["mlflow_run_id"] = sink.run_id
                getattr(sink, kind)(*payload)
            except Exception as exc:  # noqa: BLE001 - accounting must never break training
                logger.warning("goodput MLflow %s failed: %s", kind, exc)
            finally:
                if done is not None:
                    done.set()

    # -- the ledger --
    def refresh(self, run_context: Any) -> Ledger:
        """Recompute the ledger from the workers' events (cheap: a few small reads)."""
        root = self._root(run_context)
        events = read_events(root)
        self.ledger = compute(list(events.values()), job_start=self.job_start)
        self.ledger.failures = max(self.ledger.failures, len(self._failures))
        return self.ledger

    def _publish(self, run_context: Any, ledger: Ledger, final: bool) -> None:
        step = int(time.time() - self.job_start)
        gauges = self._state.setdefault("gauges", _safe_gauges(self._state.get("name", "run")))
        if gauges is not None:
            gauges.set(ledger)
        if final:
            done = threading.Event()
            self._worker().put(("finish", (ledger, step), done))
            write_bytes(self._root(run_context), "goodput/summary.json",
                        json.dumps(summary(ledger), indent=1).encode())
            done.wait(timeout=120)
            logger.info("goodput of the job:\n%s", table(ledger))
        elif time.time() - self._state.get("last_log", 0.0) >= self.log_every_s:
            self._state["last_log"] = time.time()
            self._worker().put(("log", (ledger, step), None))

    # -- Ray Train hooks --
    def after_report(self, run_context: Any, metrics: list[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        try:
            ledger = self.refresh(run_context)
            final = ledger.finished and not self._state.get("finished")
            self._publish(run_context, ledger, final)
            self._state["finished"] = self._state.get("finished") or ledger.finished
        except Exception as exc:  # noqa: BLE001 - never fail the run over accounting
            logger.warning("goodput ledger update failed: %s", exc)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self._root(run_context)  # names the MLflow run before its first entry
        texts = [f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in worker_exceptions.items()]
        self._failures.append("; ".join(texts))  # one worker-group failure, however many ranks
        for exc, text in zip(worker_exceptions.values(), texts):
            if not_retryable(exc) is not None:
                logger.error("NOT RETRYABLE (a restart will fail the same way; fix the cause "
                             "and start a new run): %s", text)
        self._worker().put(("log_failure", (len(self._failures), self._failures[-1]), None))


def _safe_gauges(run_name: str) -> RayGauges | None:
    try:
        return RayGauges(run_name)
    except Exception as exc:  # noqa: BLE001 - metrics are optional
        logger.debug("Ray metrics unavailable: %s", exc)
        return None
