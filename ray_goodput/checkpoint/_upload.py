"""One rank's hand-off: upload its staged files, declare them durable, try to commit.

The same job runs in-process (a thread of the training worker) or in the node's
:class:`~ray_goodput.node.CheckpointUploader` actor, so both paths commit identically.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ray_goodput.checkpoint import _catalog
from ray_goodput.checkpoint._manifest import Manifest, RankMarker, try_commit, write_rank_marker
from ray_goodput.storage import RetryPolicy, StorageLocation, upload_files

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadJob:
    """Everything needed to make one rank's shard of one step durable. Picklable."""

    root: StorageLocation
    step: int
    rank: int
    world_size: int
    local_dir: str
    names: tuple[str, ...]
    keep_last: int

    @property
    def num_bytes(self) -> int:
        return sum((Path(self.local_dir) / n).stat().st_size for n in self.names)


@dataclass(frozen=True)
class UploadResult:
    step: int
    rank: int
    num_bytes: int
    seconds: float
    committed: bool


def run_upload_job(job: UploadJob, *, concurrency: int = 8,
                   policy: RetryPolicy | None = None) -> UploadResult:
    """Upload, write the rank marker, try to commit, apply retention when committed.

    Raises StorageError when an upload fails after retries; then no marker is written
    and the checkpoint can never commit, which leaves the previous one as recovery point.
    """
    start = time.monotonic()
    step_loc = _catalog.step_location(job.root, job.step)
    files = [(Path(job.local_dir) / name, name) for name in job.names]
    entries = upload_files(files, step_loc, concurrency=concurrency,
                           policy=policy or RetryPolicy())
    write_rank_marker(step_loc, RankMarker(step=job.step, rank=job.rank, world_size=job.world_size,
                                           files=tuple(entries), created=time.time()))
    manifest: Manifest | None = try_commit(step_loc, job.step, job.world_size)
    if manifest is not None:
        _catalog.apply_retention(job.root, job.keep_last)
    seconds = time.monotonic() - start
    num_bytes = sum(e.size for e in entries)
    logger.debug("rank %d step %d durable: %d bytes in %.2fs", job.rank, job.step, num_bytes, seconds)
    return UploadResult(step=job.step, rank=job.rank, num_bytes=num_bytes, seconds=seconds,
                        committed=manifest is not None)
