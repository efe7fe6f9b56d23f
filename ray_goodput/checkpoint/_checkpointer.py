"""The public Checkpointer: snapshot, hand off, commit, report, restore."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import ray
import ray.train
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ray_goodput import _env
from ray_goodput.checkpoint import _catalog, _layout, _shard_plan, _state
from ray_goodput.checkpoint._arena import Arena, pick_dir, sweep_dead
from ray_goodput.checkpoint._backends import Handoff, ThreadBackend, UploadBackend
from ray_goodput.checkpoint._job import ShardJob
from ray_goodput.checkpoint._manifest import Manifest, read_manifest
from ray_goodput.checkpoint._metrics import SaveMetrics
from ray_goodput.checkpoint._ray_report import report_checkpoint
from ray_goodput.checkpoint._restore import RestoreInfo, load_checkpoint
from ray_goodput.checkpoint._uploader import ActorBackend
from ray_goodput.errors import CheckpointCorruptError, CheckpointError, ConfigError
from ray_goodput.goodput import get_recorder
from ray_goodput.runtime import WorkerContext
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    step: int
    metrics: dict[str, Any]
    handoff: Handoff
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


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _all_gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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
                 uploader: Literal["auto", "actor", "thread"] | UploadBackend = "auto") -> None:
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 (the newest committed checkpoint is never removed), got {keep_last}")
        if upload_concurrency < 1:
            raise ConfigError(f"upload_concurrency must be >= 1, got {upload_concurrency}")
        if isinstance(uploader, str) and uploader not in ("auto", "actor", "thread"):
            raise ConfigError(f"uploader must be 'auto', 'actor' or 'thread', got {uploader!r}")
        self._ctx = WorkerContext.detect()
        self.root = self._ctx.storage_root(storage_path)
        self.root.probe()
        self._run_key = hashlib.sha1(self.root.uri.encode()).hexdigest()[:16]
        self.staging = (Path(staging_dir) if staging_dir else _env.staging_root()) / self._run_key
        self.keep_last = keep_last
        self.verify_checksums = verify_checksums
        self.upload_concurrency = upload_concurrency
        self._retry = retry or RetryPolicy()
        self._uploader_choice = uploader
        self._uploader: UploadBackend | None = None if isinstance(uploader, str) else uploader
        self._arena: Arena | None = None
        self._owner_cache: tuple[list[int], dict[str, int]] | None = None
        self._pending: dict[int, _Pending] = {}
        self._last_step: int | None = None
        self._errors: list[BaseException] = []
        self._closed = False
        self.stats = SaveStats()
        self.last_restore: RestoreInfo | None = None
        self._recorder = get_recorder()
        self._metrics = SaveMetrics() if ray.is_initialized() else None
        if self._uploader is None and self._uploader_choice != "thread":
            self._uploader = self._make_uploader()
            if hasattr(self._uploader, "start"):
                self._uploader.start()

    def _make_uploader(self) -> UploadBackend:
        use_actor = self._uploader_choice == "actor" or (
            self._uploader_choice == "auto" and ray.is_initialized())
        if use_actor:
            return ActorBackend(concurrency=self.upload_concurrency, policy=self._retry)
        return ThreadBackend(concurrency=self.upload_concurrency, policy=self._retry)

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
        """Checkpoint ``state`` as of ``step``. Returns once the state is copied out of the
        training process's tensors into this rank's snapshot arena and handed off.

        Writing DCP files, uploading and committing go on in the node's uploader, which
        outlives this worker. The checkpoint is reported to Ray Train (with ``metrics``) at
        a later ``save``/``wait`` once committed. A failed background save is logged and
        counted in ``stats`` (training goes on; the previous checkpoint stays the recovery
        point) and raised by :meth:`wait`. Collective: every rank saves the same steps.
        """
        self._check_open()
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ConfigError(f"step {step} is not after the last saved step {self._last_step}")
        start = time.perf_counter()  # the loop is blocked for the whole call
        self._report_committed(block=False)
        self._wait_released()
        job = self._snapshot(step, _state.classify(state))
        handoff = self._submit(job)
        block = time.perf_counter() - start
        self._last_step = step
        self.stats.saves += 1
        self.stats.last_block_seconds = block
        self.stats.total_block_seconds += block
        self._recorder.add_checkpoint_stall(block)
        self._recorder.step(step, explicit=False)
        self._pending[step] = _Pending(step=step, metrics=dict(metrics or {}), handoff=handoff,
                                       block_seconds=block)

    def _snapshot(self, step: int, roles: _state._Roles) -> ShardJob:
        nonce = _broadcast(uuid.uuid4().hex[:12])  # one id per save, shared by its ranks
        flat, mappings = flatten_state_dict(_state.to_state_dict(roles))
        leaves = {fqn: _shard_plan.describe(value) for fqn, value in flat.items()}
        keys = _shard_plan.local_keys(leaves, self._owners(leaves), self.rank)
        tensors = {k: _local(flat[k]) for k in keys if leaves[k].kind != _shard_plan.OBJECT}
        objects = {k: pickle.dumps(flat[k]) for k in keys if leaves[k].kind == _shard_plan.OBJECT}
        arena = self._arena_for(sum(t.numel() * t.element_size() for t in tensors.values()))
        slots = arena.snapshot(tensors)
        return ShardJob(root=self.root, step=step, rank=self.rank, world_size=self.world_size,
                        arena_path=str(arena.path), slots=tuple(slots), objects=objects,
                        leaves={k: leaves[k] for k in keys}, mappings=mappings,
                        rng=_state.rng_state_bytes(),
                        local_dir=str(self.staging / _layout.step_dir(step)),
                        keep_last=self.keep_last, owner_pid=os.getpid(), nonce=nonce,
                        num_bytes=sum(s.nbytes for s in slots))

    def _owners(self, leaves: dict[str, _shard_plan.Leaf]) -> dict[str, int]:
        """Owner of each replicated leaf; exchanged across ranks only when a structure changes."""
        sig = _shard_plan.signature(leaves)
        sigs = _all_gather(sig)
        if self._owner_cache is not None and self._owner_cache[0] == sigs:
            return self._owner_cache[1]
        owners = _shard_plan.assign_owners(_all_gather(leaves))
        self._owner_cache = (sigs, owners)
        return owners

    def _arena_for(self, need_bytes: int) -> Arena:
        if self._arena is None:
            base = pick_dir(self.staging, need_bytes) / self._run_key
            sweep_dead(base)
            self._arena = Arena(base / f"rank-{self.rank:05d}-{os.getpid()}.arena")
        return self._arena

    def _submit(self, job: ShardJob) -> Handoff:
        if self._uploader is None:
            self._uploader = self._make_uploader()
        return self._uploader.submit(job)

    def _wait_released(self) -> None:
        """At most one save in flight per rank: the previous snapshot must be written out."""
        if self._pending:
            last = self._pending[max(self._pending)]
            try:
                last.handoff.released.result()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - surfaced by wait()
                self._record_failure(last.step, exc)

    def _record_failure(self, step: int, exc: BaseException) -> None:
        if any(e is exc for e in self._errors):
            return
        self._errors.append(exc)
        self.stats.failed_saves += 1
        self.stats.last_error = f"step {step}: {type(exc).__name__}: {exc}"
        logger.error("checkpoint of step %d failed; the previous committed checkpoint stays the "
                     "recovery point: %s", step, exc)
        if self._metrics is not None:
            self._metrics.failed()

    def _outcome(self, pending: _Pending, block: bool) -> bool | None:
        """True when this rank's part of ``pending`` is durable, False when it failed,
        None when still running (only with ``block=False``)."""
        if not block and not pending.handoff.durable.done():
            return None
        try:
            pending.handoff.durable.result()
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
                                  {**getattr(self._pending.get(step), "metrics", {}), "step": step})
        newest = max(committed, default=None)
        for step, ok in outcomes.items():
            if block and step not in committed and ok is not False:
                # Durable here, yet no commit: another rank failed it. Every rank says so.
                self._record_failure(step, CheckpointError(
                    f"step {step} did not commit (a rank's part never became durable)"))
            if step in committed or ok is False or (block and ok is not None) or \
                    (newest is not None and step < newest and ok is not None):
                self._pending.pop(step, None)
        if newest is not None:
            self._drop_local_copies(before=newest)

    def _committed_manifest(self, step: int) -> Manifest | None:
        """Rank 0's view; never raises (the other ranks wait for it in a broadcast)."""
        step_loc = _catalog.step_location(self.root, step)
        try:
            return read_manifest(step_loc) or _catalog.finish_orphan(step_loc, step)
        except Exception as exc:  # noqa: BLE001 - a torn or unreachable manifest is "not committed"
            logger.warning("cannot read the commit of step %d: %s", step, exc)
            return None

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
        self.wait()  # collective: called on every rank, whatever each one has pending
        t0 = time.time()
        max_step: int | None = None
        while True:
            chosen = None
            if self.rank == 0:
                found = _catalog.newest_valid(self.root, checksums=self.verify_checksums,
                                              max_step=max_step)
                chosen = found[1].to_bytes() if found else None
            chosen = _broadcast(chosen)
            if chosen is None:
                self._recorder.restored(None, t0, time.time())
                return None
            manifest = Manifest.from_bytes(chosen)
            try:
                self.last_restore = load_checkpoint(
                    state, root=self.root, manifest=manifest, staging=self.staging,
                    rank=self.rank, world_size=self.world_size, policy=self._retry)
                self._recorder.restored(manifest.step, t0, time.time())
                self._last_step = manifest.step
                return manifest.step
            except CheckpointCorruptError as exc:  # every rank sees it: DCP gathers failures
                logger.warning("checkpoint step %d is damaged (%s); falling back", manifest.step, exc)
                max_step = manifest.step - 1

    # ---- lifecycle ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

    def close(self) -> None:
        """Wait for every save (raising its error, if any), then release threads and groups."""
        if self._closed:
            return
        self._recorder.end()
        try:
            self.wait()
            if self._ctx.in_ray_train:
                # A last report, so the goodput callback sees the end even when no
                # checkpoint committed since the previous report.
                ray.train.report({"step": self._last_step, "ray_goodput_closed": 1})
        finally:
            self._closed = True
            if self._uploader is not None:
                self._uploader.close()
            if self._arena is not None:
                self._arena.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Unwinding an error: no collectives (the other ranks may be elsewhere and would
        # hang), no end-of-run record; release what this process holds and re-raise.
        self._closed = True
        if self._uploader is not None:
            self._uploader.close()
        if self._arena is not None:
            self._arena.close()
