"""Where a rank's shard job runs: an :class:`UploadBackend`.

:class:`ThreadBackend` (here) runs it in a thread of the worker; ``ActorBackend``
(``_uploader``) hands it to the node's CheckpointUploader actor."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ray_goodput.checkpoint._job import ShardJob, ShardResult, run_shard_job
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)


@dataclass
class Handoff:
    """A submitted job: ``released`` once the arena may be reused, ``durable`` once the
    rank's files are uploaded and declared durable (its result says if it committed)."""

    released: Future[None]
    durable: Future[ShardResult]


class UploadBackend(Protocol):
    def submit(self, job: ShardJob) -> Handoff: ...

    def close(self) -> None: ...


class ThreadBackend:
    """Runs jobs in a background thread of this process, FIFO.

    The job dies with the worker process; under Ray the node's CheckpointUploader is
    used instead, so that a save survives the worker that made it.
    """

    def __init__(self, *, concurrency: int, policy: RetryPolicy) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rg-uploader")
        self._concurrency = concurrency
        self._policy = policy

    def submit(self, job: ShardJob) -> Handoff:
        released: Future[None] = Future()

        def _run() -> ShardResult:
            try:
                return run_shard_job(job, concurrency=self._concurrency, policy=self._policy,
                                     on_released=lambda: released.set_result(None))
            except BaseException as exc:
                if not released.done():
                    released.set_exception(exc)
                raise

        return Handoff(released=released, durable=self._pool.submit(_run))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
