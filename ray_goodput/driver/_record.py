"""The recovery record: ``<root>/recovery/state.json``, what a ``Recovery`` decided (for the
goodput summary, MLflow, ``ray-goodput status`` and the driver's ``TorchTrainer.recovery``
after ``fit``). Written in one background thread, so no hook of a restart waits for storage;
the run's end, a stop and an abort wait for the newest record."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from ray_goodput.storage import StorageLocation, read_bytes, resolve, write_bytes

logger = logging.getLogger(__name__)

STATE_FILE = "recovery/state.json"
#: How long the run's end (or a stop) waits for the recovery record to be written.
STATE_WRITE_WAIT_S = 60.0
#: The same when the run is aborted (the user is waiting on Ctrl-C).
ABORT_WRITE_WAIT_S = 10.0


class StateWriter:
    """Writes the newest recovery record in one background thread, so no hook of a restart
    waits for storage; :meth:`flush` waits for the newest one (the run's end, a stop)."""

    def __init__(self, root: StorageLocation) -> None:
        self._root = root
        self._cond = threading.Condition()
        self._pending: bytes | None = None
        self._busy = False
        self._thread: threading.Thread | None = None

    def put(self, data: bytes) -> None:
        with self._cond:
            self._pending = data  # an older one not yet written is replaced: the newest wins
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rg-recovery-record", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None)
                data, self._pending, self._busy = self._pending, None, True
            try:
                write_bytes(self._root, STATE_FILE, data)
            except OSError as exc:  # a record for people; never a reason to fail the run
                logger.warning("could not write %s/%s: %s", self._root.uri, STATE_FILE, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout_s: float) -> None:
        with self._cond:
            done = self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout=timeout_s)
        if not done:
            logger.warning(
                "the recovery record %s/%s was not written within %.0f s; it may be stale",
                self._root.uri,
                STATE_FILE,
                timeout_s,
            )


def load_state(root: str | StorageLocation) -> dict[str, Any] | None:
    """What a Recovery recorded under ``root`` (``attempts``: attempt, t (its start, epoch
    seconds), resume_step, excluded_nodes, unhealthy; ``node_failures``; ``isolated_nodes``; ``stopped``;
    ``failures_charged``: Ray's failure budgets used, by ``FailureConfig`` field), or None."""
    try:
        return json.loads(read_bytes(resolve(root), STATE_FILE))
    except FileNotFoundError:
        return None
