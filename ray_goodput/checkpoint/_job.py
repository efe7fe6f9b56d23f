"""One rank's shard of one step, from snapshot to durable: the work of the node uploader.

The same function runs in the node's CheckpointUploader actor (the default under Ray)
or in a thread of the worker (plain torch.distributed), so both commit identically.
"""

from __future__ import annotations

import errno
import logging
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ray_goodput.checkpoint import _catalog, _layout
from ray_goodput.checkpoint._arena import TensorSlot, open_slots
from ray_goodput.checkpoint._manifest import RankMarker, try_commit, write_rank_marker
from ray_goodput.checkpoint._parts import write_part
from ray_goodput.checkpoint._shard_plan import Leaf
from ray_goodput.errors import CheckpointError
from ray_goodput.storage import RetryPolicy, StorageLocation, upload_files

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardJob:
    """Everything needed to make one rank's shard of one step durable. Picklable."""

    root: StorageLocation
    step: int
    rank: int
    world_size: int
    arena_path: str
    slots: tuple[TensorSlot, ...]
    objects: dict[str, bytes]          # non-tensor leaves this rank writes, pickled
    leaves: dict[str, Leaf]            # this rank's written leaves (shard offsets)
    mappings: dict[str, Any]           # DCP flatten mapping of the whole state dict
    rng: bytes
    local_dir: str                     # node-local staging directory of this step
    keep_last: int
    owner_pid: int
    nonce: str
    num_bytes: int = field(default=0)

    @property
    def key(self) -> str:
        return f"{self.local_dir}#{self.rank}"


@dataclass(frozen=True)
class ShardResult:
    step: int
    rank: int
    num_bytes: int
    write_seconds: float
    upload_seconds: float
    committed: bool


def _out_of_space(exc: BaseException) -> bool:
    """ENOSPC anywhere in the cause chain (DCP and torch's zip writer wrap it; when they
    hide it entirely, the caller goes by free space)."""
    todo: list[BaseException] = [exc]
    while todo:
        seen = todo.pop()
        if getattr(seen, "errno", None) == errno.ENOSPC:
            return True
        todo += [e for e in (seen.__cause__, seen.__context__) if e is not None]
        # DCP's CheckpointException carries each rank's error in ``failures``.
        todo += [f[0] if isinstance(f, tuple) else f for f in getattr(seen, "failures", {}).values()
                 if isinstance(f, (tuple, BaseException))]
    return False


def write_local(job: ShardJob) -> list[str]:
    """DCP-write the snapshot into the staging dir; after this the arena may be reused."""
    out = Path(job.local_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat: dict[str, Any] = open_slots(job.arena_path, list(job.slots)) if job.slots else {}
    flat.update({fqn: pickle.loads(raw) for fqn, raw in job.objects.items()})  # noqa: S301
    try:
        names = write_part(flat, job.leaves, job.mappings, job.rank, job.nonce, out)
    except (Exception, CheckpointException) as exc:
        free = shutil.disk_usage(out).free
        # torch's zip writer can turn ENOSPC into "unexpected pos": go by free space too.
        if _out_of_space(exc) or free < job.num_bytes * 1.1:
            raise CheckpointError(
                f"staging dir {out} is out of space ({free} bytes free, the shard needs "
                f"~{job.num_bytes}): set Checkpointer(staging_dir=...) or "
                f"RAY_GOODPUT_STAGING_DIR to a larger local disk (No space left on device)"
            ) from exc
        raise
    extras = out / _layout.extras_file(job.rank, job.nonce)
    extras.parent.mkdir(parents=True, exist_ok=True)
    extras.write_bytes(job.rng)
    return [*names, _layout.extras_file(job.rank, job.nonce)]


def upload_and_commit(job: ShardJob, names: list[str], *, concurrency: int,
                      policy: RetryPolicy) -> tuple[int, bool]:
    """Upload, declare durable, try to commit (and apply retention when committed).

    An upload that fails after retries raises; then no marker is written, the step can
    never commit, and the previous committed checkpoint stays the recovery point.
    """
    step_loc = _catalog.step_location(job.root, job.step)
    files = [(Path(job.local_dir) / n, n) for n in names]
    entries = upload_files(files, step_loc, concurrency=concurrency, policy=policy)
    write_rank_marker(step_loc, RankMarker(step=job.step, rank=job.rank, world_size=job.world_size,
                                           files=tuple(entries), created=time.time(), nonce=job.nonce))
    manifest = try_commit(step_loc, job.step, job.world_size, job.nonce, Path(job.local_dir))
    if manifest is not None and manifest.nonce != job.nonce:
        logger.warning("step %d was already committed by an earlier attempt; keeping that one",
                       job.step)
    committed = manifest is not None
    if committed:
        try:
            _catalog.apply_retention(job.root, job.keep_last)
        except Exception as exc:  # noqa: BLE001 - the save is committed; retention retries next time
            logger.warning("retention after step %d failed: %s", job.step, exc)
    return sum(e.size for e in entries), committed


def run_shard_job(job: ShardJob, *, concurrency: int, policy: RetryPolicy,
                  on_released: Callable[[], None] = lambda: None) -> ShardResult:
    """Write locally, release the arena (``on_released``), upload, commit."""
    start = time.monotonic()
    names = write_local(job)
    written = time.monotonic()
    on_released()
    num_bytes, committed = upload_and_commit(job, names, concurrency=concurrency, policy=policy)
    return ShardResult(step=job.step, rank=job.rank, num_bytes=num_bytes,
                       write_seconds=written - start, upload_seconds=time.monotonic() - written,
                       committed=committed)
