"""Where a rank's upload job runs: a thread of the worker, or the node's uploader actor."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from ray_goodput.checkpoint._upload import UploadJob, UploadResult, run_upload_job
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)


class UploadBackend(Protocol):
    def submit(self, job: UploadJob) -> Future[UploadResult]: ...

    def close(self) -> None: ...


class ThreadUploader:
    """Uploads in a background thread of this process, one job at a time (FIFO).

    A job dies with its worker process: use the node actor where the upload must
    outlive the worker.
    """

    def __init__(self, *, concurrency: int, policy: RetryPolicy) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rg-uploader")
        self._concurrency = concurrency
        self._policy = policy

    def submit(self, job: UploadJob) -> Future[UploadResult]:
        return self._pool.submit(run_upload_job, job, concurrency=self._concurrency,
                                 policy=self._policy)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
