"""The public Checkpointer: stage, hand off, commit, report, restore."""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ray_goodput import _env
from ray_goodput.checkpoint import _catalog, _layout, _state
from ray_goodput.checkpoint._backends import ThreadUploader, UploadBackend
from ray_goodput.checkpoint._manifest import Manifest, read_manifest
from ray_goodput.checkpoint._restore import RestoreInfo, load_checkpoint
from ray_goodput.checkpoint._staging import HostBuffers
from ray_goodput.checkpoint._train_context import WorkerContext, report_checkpoint
from ray_goodput.checkpoint._upload import UploadJob, UploadResult
from ray_goodput.errors import CheckpointError, ConfigError
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    step: int
    metrics: dict[str, Any]
    write: Future[Future[UploadResult]]
    block_seconds: float


@dataclass
class SaveStats:
    """Counters of this rank's saves. Seconds are wall time."""

    saves: int = 0
    failed_saves: int = 0
    committed: list[int] = field(default_factory=list)
    last_block_seconds: float = 0.0
    total_block_seconds: float = 0.0
    last_error: str | None = None


def _broadcast(obj: Any, src: int = 0) -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Checkpointer:
    """Sharded, committed, asynchronous checkpoints for one training worker (rank).

    Every rank creates one, with the same arguments, and calls ``save``/``restore``/
    ``wait``/``close`` at the same points (they contain collectives). Storage is probed
    here: an unreachable or read-only ``storage_path`` raises StorageError at once.
    """

    def __init__(self, storage_path: str | None = None, *, keep_last: int = 3,
                 staging_dir: str | None = None, upload_concurrency: int = 8,
                 verify_checksums: bool = False, retry: RetryPolicy | None = None,
                 uploader: UploadBackend | None = None) -> None:
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 (the newest committed checkpoint is never removed), got {keep_last}")
        if upload_concurrency < 1:
            raise ConfigError(f"upload_concurrency must be >= 1, got {upload_concurrency}")
        self._ctx = WorkerContext.detect()
        self.root = self._ctx.storage_root(storage_path)
        self.root.probe()
        run_key = hashlib.sha1(self.root.uri.encode()).hexdigest()[:16]
        self.staging = Path(staging_dir) if staging_dir else _env.staging_root()
        self.staging = self.staging / run_key
        self.keep_last = keep_last
        self.verify_checksums = verify_checksums
        self._retry = retry or RetryPolicy()
        self._pg = dist.new_group(backend="gloo") if self._distributed() else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rg-ckpt-write")
        self._uploader = uploader or ThreadUploader(concurrency=upload_concurrency, policy=self._retry)
        self._buffers = HostBuffers()
        self._pending: dict[int, _Pending] = {}
        self._errors: list[BaseException] = []
        self._closed = False
        self.stats = SaveStats()
        self.last_restore: RestoreInfo | None = None

    @staticmethod
    def _distributed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    # ---- save -----------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None) -> None:
        """Checkpoint ``state`` as of ``step``. Returns once the state is staged in host memory.

        Writing the DCP files, uploading and committing go on in the background; the
        checkpoint is reported to Ray Train (with ``metrics``) at a later ``save``/``wait``
        once committed. A failed background save is logged and counted in ``stats``
        (training goes on, the previous checkpoint stays the recovery point) and raised by
        :meth:`wait`.
        """
        self._check_open()
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if self._pending and step <= max(self._pending):
            raise ConfigError(f"step {step} is not after the last saved step {max(self._pending)}")
        self._report_committed(block=False)
        self._wait_staged()
        start = time.perf_counter()
        roles = _state.classify(state)
        snapshot = self._buffers.snapshot(_state.to_state_dict(roles))
        rng = _state.rng_state_bytes()
        block = time.perf_counter() - start
        self.stats.saves += 1
        self.stats.last_block_seconds = block
        self.stats.total_block_seconds += block
        write = self._writer.submit(self._write_and_hand_off, step, snapshot, rng)
        self._pending[step] = _Pending(step=step, metrics=dict(metrics or {}), write=write,
                                       block_seconds=block)

    def _write_and_hand_off(self, step: int, snapshot: dict[str, Any], rng: bytes) -> Future[UploadResult]:
        local = self.staging / _layout.step_dir(step)
        if self.rank == 0 or not local.exists():
            shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True, exist_ok=True)
        writer = FileSystemWriter(local, single_file_per_rank=True, sync_files=False,
                                  thread_count=1, overwrite=True)
        dcp.save(snapshot, storage_writer=writer, process_group=self._pg,
                 no_dist=not self._distributed())
        extras = local / _layout.extras_file(self.rank)
        extras.parent.mkdir(parents=True, exist_ok=True)
        extras.write_bytes(rng)
        names = _layout.dcp_files_of_rank([p.name for p in local.iterdir()], self.rank)
        if self.rank == 0:
            names.append(_layout.DCP_METADATA)
        names.append(_layout.extras_file(self.rank))
        job = UploadJob(root=self.root, step=step, rank=self.rank, world_size=self.world_size,
                        local_dir=str(local), names=tuple(names), keep_last=self.keep_last)
        return self._uploader.submit(job)

    def _wait_staged(self) -> None:
        """At most one save in flight per rank: the previous local write must be done."""
        if self._pending:
            last = self._pending[max(self._pending)]
            try:
                last.write.result()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - recorded, surfaced by wait()
                self._record_failure(last.step, exc)

    def _record_failure(self, step: int, exc: BaseException) -> None:
        if any(e is exc for e in self._errors):
            return
        self._errors.append(exc)
        self.stats.failed_saves += 1
        self.stats.last_error = f"step {step}: {type(exc).__name__}: {exc}"
        logger.error("checkpoint of step %d failed; the previous committed checkpoint stays the "
                     "recovery point: %s", step, exc)

    def _outcome(self, pending: _Pending, block: bool) -> bool | None:
        """True when this rank's part of ``pending`` is durable, False when it failed,
        None when still running (only with ``block=False``)."""
        if not block and not pending.write.done():
            return None
        try:
            upload = pending.write.result()
            if not block and not upload.done():
                return None
            upload.result()
            return True
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            self._record_failure(pending.step, exc)
            return False

    # ---- commit bookkeeping and reporting ----------------------------------------------

    def _report_committed(self, block: bool) -> None:
        """Agree across ranks on which pending steps are committed; report them in order."""
        outcomes = {s: self._outcome(p, block) for s, p in self._pending.items()}
        if block and self._distributed():
            dist.barrier()
        committed: list[int] = []
        if self.rank == 0:
            committed = [s for s, ok in outcomes.items()
                         if ok and self._committed_manifest(s) is not None]
        committed = _broadcast(committed)
        for step in sorted(committed):
            self.stats.committed.append(step)
            if self._ctx.in_ray_train:
                report_checkpoint(self._ctx, _catalog.step_location(self.root, step),
                                  {**self._pending[step].metrics, "step": step})
        newest = max(committed, default=None)
        for step, ok in outcomes.items():
            if step in committed or ok is False or (block and ok is not None) or \
                    (newest is not None and step < newest and ok is not None):
                self._pending.pop(step, None)
        if newest is not None:
            self._drop_local_copies(before=newest)

    def _committed_manifest(self, step: int) -> Manifest | None:
        step_loc = _catalog.step_location(self.root, step)
        return read_manifest(step_loc) or _catalog.finish_orphan(step_loc, step)

    def _drop_local_copies(self, before: int) -> None:
        if not self.staging.exists():
            return
        for child in self.staging.iterdir():
            step = _layout.parse_step(child.name)
            if step is not None and step < before and step not in self._pending:
                shutil.rmtree(child, ignore_errors=True)

    def wait(self) -> None:
        """Block until every save issued so far is committed (and reported); raise the
        first error that prevented one. Collective: every rank must call it."""
        self._check_open()
        self._report_committed(block=True)
        if self._errors:
            errors, self._errors = self._errors, []
            raise CheckpointError(f"{len(errors)} checkpoint save(s) failed; first: {errors[0]}") from errors[0]

    # ---- restore ------------------------------------------------------------------------

    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest committed checkpoint into ``state`` in place; return its step,
        or None when there is none. Collective. Damaged checkpoints are skipped with a
        warning. The world size may differ from the one that saved it (DCP resharding)."""
        self._check_open()
        if self._pending:
            self.wait()
        chosen = None
        if self.rank == 0:
            found = _catalog.newest_valid(self.root, checksums=self.verify_checksums)
            chosen = (found[1].step, found[1].to_bytes()) if found else None
        chosen = _broadcast(chosen)
        if chosen is None:
            return None
        manifest = Manifest.from_bytes(chosen[1])
        self.last_restore = load_checkpoint(
            state, root=self.root, manifest=manifest, staging=self.staging, rank=self.rank,
            world_size=self.world_size, process_group=self._pg)
        return manifest.step

    # ---- lifecycle ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

    def close(self) -> None:
        """Wait for every save (raising its error, if any), then release threads and groups."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            self._uploader.close()
            if self._pg is not None:
                dist.destroy_process_group(self._pg)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
