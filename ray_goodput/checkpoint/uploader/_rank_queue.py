"""One rank's queue in an uploader: one job running, at most one waiting.

A newer job supersedes the waiting one (it is dropped, never written), so a rank holds at
most two snapshots however slow uploads are, and the newest state is always the next to
go. Jobs run one at a time, in order, so per rank a save never overtakes an older one.

A job's snapshot arena is mapped when the job is *accepted* (:class:`Ticket`): the
mapping keeps the data alive even if the arena file is unlinked meanwhile (a worker
leaving ``with Checkpointer`` on an error, or sweeping a dead process's arenas). Before it
reads the snapshot, a job claims it (``_arena_files.claim``); a job whose worker claimed it first
was superseded there (its arena already holds a newer snapshot) and ends unread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray_goodput._faults import fault_point
from ray_goodput.checkpoint.save._arena import open_slots
from ray_goodput.checkpoint.save._arena_files import claim, drop_claim
from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.checkpoint.save._save_state import SaveRecord, SaveState
from ray_goodput.checkpoint.uploader._shard_job import ShardJob, ShardResult, run_shard_job
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)


class Ticket:
    """An accepted job: its mapped snapshot, its record, and when it was released/done.
    ``handoff``: the worker's futures, when the worker is this process (``ThreadBackend``);
    the ticket settles them itself."""

    def __init__(self, job: ShardJob, handoff: Handoff | None = None) -> None:
        self.job = job
        self.handoff = handoff
        self.released = threading.Event()
        self.done = threading.Event()
        self.result: ShardResult | None = None
        self.error: BaseException | None = None
        self.origin = ""  # the worker connection it came on ("" by an actor call)
        self.callbacks: list[Callable[[Ticket], None]] = []  # when done
        self.release_callbacks: list[Callable[[Ticket], None]] = []  # when the arena is free
        self.record = SaveRecord(job.step, job.save_id)
        self.tensors: dict[str, Any] = open_slots(job.arena_path, list(job.slots)) if job.slots else {}

    def release(self) -> None:
        self.tensors = {}  # drop the mapping: the arena may be reused or unlinked
        self.released.set()
        if self.handoff is not None and not self.handoff.released.done():
            self.handoff.released.set_result(None)
        for callback in self.release_callbacks:
            callback(self)

    def finish(self, result: ShardResult | None, error: BaseException | None) -> None:
        self.result, self.error = result, error
        if not self.released.is_set():
            self.release()
        self._drop_claim()
        self.done.set()
        if self.handoff is not None:
            if error is not None:
                self.handoff.durable.set_exception(error)
            else:
                self.handoff.durable.set_result(result)
        for callback in self.callbacks:
            callback(self)

    def _drop_claim(self) -> None:
        try:
            drop_claim(self.job.arena_path, self.job.key)
        except OSError as exc:  # a stray empty file, swept with its dead worker's arenas
            logger.debug("could not remove the claim of %s: %s", self.job.key, exc)

    def supersede(self, by: str = "the uploader") -> None:
        self.record.advance(SaveState.SUPERSEDED)
        logger.info(
            "save of step %d rank %d superseded by a newer save before it started (decided by %s)",
            self.job.step,
            self.job.rank,
            by,
        )
        self.finish(ShardResult.superseded(self.job), None)

    def run(self, *, concurrency: int, policy: RetryPolicy, newer: Callable[[], bool] = lambda: False) -> None:
        try:
            if not claim(self.job.arena_path, self.job.key):
                self.supersede(by="its worker")  # the arena already holds a newer snapshot: read nothing
                return
            result = run_shard_job(
                self.job,
                self.record,
                self.tensors,
                concurrency=concurrency,
                policy=policy,
                on_released=self.release,
                newer=newer,
            )
        except BaseException as exc:  # noqa: BLE001 - reported to the worker at its next sync
            self.record.advance(SaveState.FAILED, f"{type(exc).__name__}: {exc}")
            logger.error("save of step %d rank %d failed: %s", self.job.step, self.job.rank, exc)
            self.finish(None, exc)
            return
        self.finish(result, None)


class RankLane:
    """Runs one rank's tickets in order; a newer ticket supersedes the waiting one."""

    def __init__(self, *, concurrency: int = 8, policy: RetryPolicy | None = None) -> None:
        self._concurrency = concurrency
        self._policy = policy or RetryPolicy()  # for jobs that carry none
        self._lock = threading.Lock()
        self._waiting: Ticket | None = None
        # (worker pid, generation) -> the newest hand-off (ShardJob.seq) the lane took from
        # that worker: one arriving later with an older one is stale
        self._newest: dict[tuple[int, int], int] = {}
        self._stopping = False  # shut down with stop: the job retrying an outage gives up
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rg-lane")

    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket``; the job waiting before it is superseded, unless the lane took a
        later hand-off of the same worker process before (waiting, running or ended): jobs
        of one worker can arrive out of order (the older one unread on a connection that
        broke, the newer one resent on a new connection), and then the older one is
        dropped. Later is by hand-off (``ShardJob.seq``), not step: a worker that restored
        an older step saves lower steps next."""
        fault_point("save.queued")  # before the lane holds the ticket: a raise leaves no orphan
        job = ticket.job
        worker = (job.owner_pid, job.generation)
        with self._lock:
            if job.seq and self._newest.get(worker, 0) > job.seq:
                old, stale = None, ticket
            else:
                old, self._waiting, stale = self._waiting, ticket, None
                self._newest[worker] = max(job.seq, self._newest.get(worker, 0))
        if old is not None:
            old.supersede()
        if stale is not None:
            stale.supersede(by="a later save of its worker that arrived first")
            return
        self._pool.submit(self._drain)

    def _drain(self) -> None:
        with self._lock:
            ticket, self._waiting = self._waiting, None
        if ticket is not None:
            job = ticket.job
            policy = job.retry or self._policy
            if self._stopping:  # closing: one try per request (a healthy storage still commits it)
                policy = dataclasses.replace(policy, attempts=1)
            ticket.run(concurrency=job.concurrency, policy=policy, newer=self._has_waiting)

    def _has_waiting(self) -> bool:
        """What a job retrying a storage outage asks between rounds: a newer save waits (it
        gives way to it), or the lane stops (it gives up)."""
        with self._lock:
            return self._waiting is not None or self._stopping

    def shutdown(self, wait: bool = True, *, stop: bool = False) -> None:
        """Stop taking tickets; ``wait``: until the running job and the waiting one ended.
        ``stop``: a job retrying a storage outage gives up at its next round, so that the
        wait is not its whole retry budget (a healthy storage's saves still commit)."""
        if stop:
            with self._lock:
                self._stopping = True
        self._pool.shutdown(wait=wait)
