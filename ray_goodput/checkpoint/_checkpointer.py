"""The public Checkpointer: snapshot, hand off, commit, report, restore.

Every collective call (``save``, ``wait``, ``close``, ``restore``) ends with the same
outcome on every rank: the ranks exchange what each saw (``_collective``) and act on the
agreed answer, so none raises while another enters Ray Train's ``report`` barrier.

``save`` itself blocks only for the snapshot copy: the save id is derived from the
generation and the step, the owner plan is reused while the state's structure is
unchanged, and the outcome agreement and Ray Train report run at ``wait``/``close`` and
every ``sync_every``-th save (a count, so every rank syncs at the same save).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

from torch.distributed.checkpoint.api import CheckpointException

from ray_goodput import _env
from ray_goodput.checkpoint._outcomes import Outcomes, Pending, SaveStats
from ray_goodput.checkpoint.protocol import _collective, _layout, _lineage
from ray_goodput.checkpoint.restore._choose_and_load import choose_and_load
from ray_goodput.checkpoint.restore._load import RestoreInfo
from ray_goodput.checkpoint.restore._local_precheck import LocalGuess
from ray_goodput.checkpoint.save._arena_pair import ArenaPair
from ray_goodput.checkpoint.save._handoff import Handoff, UploadBackend
from ray_goodput.checkpoint.save._local_copies import LocalCopyDropper
from ray_goodput.checkpoint.save._ray_report import report_closed
from ray_goodput.checkpoint.save._save_state import SaveRecord
from ray_goodput.checkpoint.save._schedule import SaveSchedule
from ray_goodput.checkpoint.save._snapshot import Snapshotter
from ray_goodput.checkpoint.uploader._calls import wait_for_uploads
from ray_goodput.checkpoint.uploader._client import ActorBackend
from ray_goodput.checkpoint.uploader._metrics import SaveMetrics
from ray_goodput.checkpoint.uploader._shard_job import ShardJob
from ray_goodput.checkpoint.uploader._thread_backend import ThreadBackend
from ray_goodput.errors import CheckpointError, ConfigError
from ray_goodput.goodput import get_recorder
from ray_goodput.runtime import WorkerContext, ray_initialized
from ray_goodput.runtime._resume import is_restart, restore_upload_wait_s, spend_decision, take_decision
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "SaveStats"]

#: How long a clean ``close()`` lets superseded node-local copies finish being deleted
#: (seconds for a GPU-sized shard); what is left is collected by the run's next
#: Checkpointer on the node.
_DROP_JOIN_S = 60.0
#: This process's save hand-offs, in order, across its Checkpointers (``ShardJob.seq``).
_HANDOFFS = itertools.count(1)
#: How long rank 0 of a restore that chooses for itself (no driver decision for its
#: storage) waits for the saves of its storage still uploading in the node uploaders.
RESTORE_UPLOAD_WAIT_S = 120.0


def _best_effort(what: str, fn: Any) -> None:
    """Storage bookkeeping that only rank 0 does outside a collective: it must not raise."""
    try:
        fn()
    except OSError as exc:
        logger.warning("%s failed (the restore goes on): %s", what, exc)


def _failed_handoff(exc: BaseException) -> Handoff:
    released: Future[None] = Future()
    released.set_result(None)
    durable: Future[Any] = Future()
    durable.set_exception(exc if isinstance(exc, Exception) else CheckpointError(f"{type(exc).__name__}: {exc}"))
    return Handoff(released=released, durable=durable, key="")


def _check_args(
    *,
    keep_last: int,
    upload_concurrency: int,
    sync_every: int,
    uploader: object,
    wait_timeout_s: float,
    max_recovery_point_age_s: float | None,
) -> None:
    """ConfigError naming the fix for a bad ``Checkpointer`` argument."""
    if keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1 (the newest committed checkpoint is never removed), got {keep_last}")
    if upload_concurrency < 1:
        raise ConfigError(f"upload_concurrency must be >= 1, got {upload_concurrency}")
    if sync_every < 1:
        raise ConfigError(f"sync_every must be >= 1 (saves between outcome agreements), got {sync_every}")
    if isinstance(uploader, str) and uploader not in ("auto", "actor", "thread"):
        raise ConfigError(f"uploader must be 'auto', 'actor' or 'thread', got {uploader!r}")
    if not 0 < wait_timeout_s < threading.TIMEOUT_MAX / 2:
        raise ConfigError(
            f"wait_timeout_s must be > 0 and finite (seconds wait() waits for uploads), got {wait_timeout_s}"
        )
    if max_recovery_point_age_s is not None and not 0 < max_recovery_point_age_s < threading.TIMEOUT_MAX / 2:
        raise ConfigError(
            "max_recovery_point_age_s must be > 0 and finite (seconds the newest committed checkpoint "
            f"may age while saves fail), or None for the default; got {max_recovery_point_age_s}"
        )


#: How long a restart's storage probe (``Recovery`` tells the workers they run one) goes
#: on through errors an outage gives before it raises StorageUnreachableError (no new
#: round of the probe starts after it; the round under way ends within its retries).
#: Below the generation claim's wait for the probe (``_lineage.CLAIM_TIMEOUT_S``) and the
#: process group's timeout (Ray's 1800 s), in which the ranks that finished probing wait
#: for this one.
RESTART_PROBE_WAIT_S = 300.0


class Checkpointer:
    """Sharded, committed, asynchronous checkpoints for one training worker (rank).

    Every rank creates one, with the same arguments, and calls ``save``/``restore``/
    ``wait``/``close`` at the same points: they contain collectives, and so does the
    constructor once a process group is up (create it after the rank's device is set, as
    Ray Train does before the training function). Storage is probed here: an unreachable
    or read-only ``storage_path`` raises StorageUnusableError at once, on every rank (on a
    restart that ``Recovery`` announces, storage failing as an outage does is waited for
    first, up to ``RESTART_PROBE_WAIT_S``).

    A save that fails in the background (storage down past its retries) does not stop
    training: it is logged and counted, its uploads keep retrying while no newer save waits,
    and a newer commit leaves it behind. The run stops with RecoveryPointTooOldError only
    when the newest committed checkpoint's state is older than ``max_recovery_point_age_s``
    (default: 10 save intervals, at least 600 s), and ``wait``/``close`` raise when the
    newest save failed. A newer run that took ``storage_path`` raises FencedError.
    """

    def __init__(
        self,
        storage_path: str | None = None,
        *,
        keep_last: int = 3,
        staging_dir: str | None = None,
        upload_concurrency: int = 8,
        verify_checksums: bool = False,
        retry: RetryPolicy | None = None,
        uploader: Literal["auto", "actor", "thread"] | UploadBackend = "auto",
        sync_every: int = 8,
        every: int | Literal["auto"] | None = None,
        mtbf_hours: float | None = None,
        wait_timeout_s: float = 3600.0,
        max_recovery_point_age_s: float | None = None,
    ) -> None:
        _check_args(
            keep_last=keep_last,
            upload_concurrency=upload_concurrency,
            sync_every=sync_every,
            uploader=uploader,
            wait_timeout_s=wait_timeout_s,
            max_recovery_point_age_s=max_recovery_point_age_s,
        )
        self._ctx = WorkerContext.detect()
        schedule = SaveSchedule(every, world_size=self.world_size, mtbf_hours=mtbf_hours, sync_every=sync_every)
        self.root = self._ctx.storage_root(storage_path)
        self._retry = retry or RetryPolicy()
        self._early_claim = self._probe_and_claim()
        self._open_staging(staging_dir)
        self.keep_last = keep_last
        self.verify_checksums = verify_checksums
        self.upload_concurrency = upload_concurrency
        self._uploader_choice = uploader
        self.wait_timeout_s = wait_timeout_s
        self._schedule = schedule
        self._tick: float | None = None
        self._token = ""
        self._uploader: UploadBackend | None = None if isinstance(uploader, str) else uploader
        self._sync_next = False  # whether the next save first agrees the outcomes so far
        self._last_step: int | None = None
        self._generation: int | None = None
        self._pinning: threading.Thread | None = None  # rank 0's resume pin, written in the background
        self._closed = False
        self.last_restore: RestoreInfo | None = None
        self._recorder = get_recorder()
        self._outcomes = Outcomes(
            ctx=self._ctx,
            root=self.root,
            schedule=schedule,
            recorder=self._recorder,
            metrics=SaveMetrics() if ray_initialized() else None,
            dropper=self._dropper,
            max_age_s=max_recovery_point_age_s,
        )
        if self._uploader is None:  # the thread backend starts nothing before a save
            self._uploader = self._make_uploader()
            if hasattr(self._uploader, "start"):
                self._uploader.start()

    def _open_staging(self, staging_dir: str | None) -> None:
        """This run's side on this node: its staging dir, the dropper of its node-local
        copies, and the rank's snapshot arenas."""
        self._run_key = hashlib.sha1(self.root.uri.encode()).hexdigest()[:16]
        self.staging = (Path(staging_dir) if staging_dir else _env.staging_root()) / self._run_key
        self._dropper = LocalCopyDropper(self.staging)
        self._dropper.sweep()  # what a dead worker of this run on this node was deleting
        self._arenas = ArenaPair(self.staging, self._run_key, self.rank, self.world_size)
        self._snapshots = Snapshotter(self._arenas, self.rank)

    def _probe_and_claim(self) -> _lineage.EarlyClaim | None:
        """Probe the storage root; collective: when it fails on any rank (unreachable,
        read-only), every rank raises that rank's StorageUnusableError. On a restart
        (``Recovery`` says so) a probe failing as an outage does goes on for up to
        ``RESTART_PROBE_WAIT_S`` first: within rank 0's generation claim's wait for the
        probe and the process group's timeout, which the ranks that finished probing wait
        in. Rank 0 claims the generation now, beside the probe; the first save only waits
        for it."""
        claim = _lineage.EarlyClaim(self.root, self._retry) if self.rank == 0 else None
        error: Exception | None = None
        try:
            try:
                self.root.probe(self._retry, outage_wait_s=RESTART_PROBE_WAIT_S if is_restart() else 0.0)
            except Exception as exc:  # noqa: BLE001 - agreed: a rank raising alone leaves its peers in a collective
                error = exc
            _collective.agree(error)
        except BaseException:
            if claim is not None:
                claim.abandon()
            raise
        if claim is not None:
            claim.probed()
        return claim

    def _make_uploader(self) -> UploadBackend:
        use_actor = self._uploader_choice == "actor" or (self._uploader_choice == "auto" and ray_initialized())
        if use_actor:
            # The actor's wait for the result ends too: a hand-off can queue behind other
            # saves before wait() starts its clock, hence twice the bound wait() gives.
            return ActorBackend(durable_timeout_s=2 * self.wait_timeout_s, root=self.root)
        return ThreadBackend(concurrency=self.upload_concurrency, policy=self._retry)

    @property
    def stats(self) -> SaveStats:
        """Counters of this rank's saves (:class:`SaveStats`: equal on every rank but the
        block times)."""
        return self._outcomes.stats

    @property
    def _pending(self) -> dict[int, Pending]:
        return self._outcomes.pending

    @property
    def recovery_point_age_s(self) -> float:
        """Seconds since the state of the newest committed checkpoint (this attempt's
        restore or save; before either, since this Checkpointer was made): the work a
        failure now would lose. This rank's clock, now."""
        return self._outcomes.age_s()

    @property
    def sync_every(self) -> int:
        """Saves between outcome agreements (the constructor's ``sync_every``)."""
        return self._schedule.sync_every

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def generation(self) -> int | None:
        """This attempt's generation: claimed in the background from construction on,
        agreed across ranks at the first save (None before it)."""
        return self._generation

    def _ensure_generation(self) -> int:
        """Collective on first use: rank 0 claims this attempt's generation and draws the
        token that, with the step, names every save of it (no collective per save)."""
        if self._generation is None:
            self._generation, self._token = _collective.on_rank0(self._claim, "claiming a checkpoint generation")
        return self._generation

    def _claim(self) -> tuple[int, str]:
        """Rank 0: the claim started at construction, once (a failed one is made again at
        the next call, not raised for ever)."""
        early, self._early_claim = self._early_claim, None
        return early.result() if early is not None else _lineage.claim_attempt(self.root, self._retry)

    # ---- save -----------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None) -> None:
        """Checkpoint ``state`` as of ``step``. Returns once the state is copied into one of
        this rank's two snapshot arenas and handed off; never waits for an upload.

        Writing DCP files, uploading and committing go on in the node's uploader, which
        outlives this worker. A save still waiting when a newer one comes is superseded
        (dropped, logged, counted in ``stats.superseded``). At ``wait``/``close`` and every
        ``sync_every``-th save (no collective runs on the other saves) the newest save
        committed since the last of them is reported to Ray Train, with its ``metrics``. A
        failed save is logged and counted (the previous checkpoint stays the recovery
        point); training goes on. At those syncs every rank raises FencedError (a newer
        run took the storage path) or RecoveryPointTooOldError (the recovery point
        outgrew its bound) alike.
        Collective: every rank saves the same steps.
        """
        self._check_open()
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ConfigError(f"step {step} is not after the last saved step {self._last_step}")
        start = time.perf_counter()  # the loop is blocked for the whole call
        saved_at = time.time()
        if self._sync_next:
            self._resolve(block=False)  # a count: every rank syncs at the same save
        generation = self._ensure_generation()
        spend_decision()  # a restore after this is a rollback: it chooses for itself
        save_id, job = self._job(step, generation)
        try:
            handoff = self._snapshots.hand_off(state, job=job, backend=self._uploader, step_of=self._pending_step_of)
        except ConfigError:
            raise  # bad input (the same on every rank), not a failed save
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed at the next sync
            # No collective here: the failure is agreed (and raised on every rank) by wait().
            handoff = _failed_handoff(exc)
        block = time.perf_counter() - start
        self._last_step = step
        self._recorder.add_checkpoint_stall(block)
        self._recorder.step(step, explicit=False)
        self._outcomes.add(
            Pending(
                step=step,
                metrics=dict(metrics or {}),
                handoff=handoff,
                block_seconds=block,
                record=SaveRecord(step, save_id),
                saved_at=saved_at,
            )
        )
        self._sync_next = self._schedule.after_save(block, saves_done=self._outcomes.stats.saves)

    def _job(self, step: int, generation: int) -> tuple[str, Callable[..., ShardJob]]:
        """The save's id, and the rank's shard job of it, less what the hand-off adds (its
        snapshot)."""
        rank, world_size = self.rank, self.world_size
        # Unique without a collective: a generation is claimed once per Checkpointer, its
        # steps only grow, and a restore that sets them back draws a new token.
        save_id = _layout.save_id(generation, f"{self._token}{step:x}")
        return save_id, functools.partial(
            ShardJob,
            root=self.root,
            step=step,
            rank=rank,
            world_size=world_size,
            local_dir=str(self.staging / _layout.step_dir(step)),
            keep_last=self.keep_last,
            owner_pid=os.getpid(),
            save_id=save_id,
            generation=generation,
            concurrency=self.upload_concurrency,
            retry=self._retry,
            retry_for_s=self._outcomes.bound_s,
            seq=next(_HANDOFFS),
        )

    def maybe_save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None) -> bool:
        """Call once per step: saves when the schedule (``every=N`` or ``every="auto"``) says
        ``step`` is due, and returns whether it saved. With ``"auto"`` the interval is Daly's
        optimum from the measured step and save-blocking times and the MTBF (``mtbf_hours``,
        or 1% AFR per rank); every rank decides the same. Collective like :meth:`save`."""
        now = time.perf_counter()
        if self._tick is not None:
            self._schedule.observe_step(now - self._tick)  # excludes the previous save's block
        due = self._schedule.due(step, self._last_step)
        if due:
            self.save(step, state, metrics=metrics)
        self._tick = time.perf_counter()
        return due

    def _resolve(self, block: bool) -> None:
        self._outcomes.resolve(block=block, timeout_s=self.wait_timeout_s)

    def _pending_step_of(self, handoff: Handoff | None) -> int:
        return next((s for s, p in self._pending.items() if p.handoff is handoff), -1)

    def wait(self) -> None:
        """Block until every save issued so far has committed, been superseded or failed
        (and committed ones are reported); then raise, on every rank alike, when the newest
        save failed (nothing newer stands in for it; raised once), the recovery point
        outgrew its bound, or a newer run took the storage path. An older failed save that
        a newer commit left behind is not raised: see ``stats``. Collective: every rank
        must call it."""
        self._check_open()
        self._resolve(block=True)
        self._outcomes.raise_if_newest_failed()

    # ---- restore ------------------------------------------------------------------------

    def restore(self, state: dict[str, Any]) -> int | None:
        """Load a committed checkpoint into ``state`` in place; return its step, or None
        when there is none. Collective; every rank loads the same one or raises the same
        error.

        With a driver decision for this attempt (``Recovery``) it loads exactly that step
        (None: start fresh); otherwise the newest intact committed checkpoint. A damaged
        one is quarantined with a warning and every rank falls back to the previous intact
        one. The world size may differ from the one that saved it (DCP resharding).
        Before the first save, it also gets that save ready (``_arena_pair``).
        """
        step = self._restore(state)
        self._arenas.prepare(state)  # the first save's arena, made ready while the loop starts
        return step

    def _restore(self, state: dict[str, Any]) -> int | None:
        self._check_open()
        self._arenas.stop_watching_steps()  # its made-up steps are not the optimizers' first
        if self.stats.saves:  # none yet (every rank alike: saves are collective): nothing to settle
            self.wait()  # collective: called on every rank, whatever each one has pending
            # A rollback sets the steps back: the steps saved again must not take their
            # earlier saves' ids (a rank's marker of such a save would count for the new
            # one). The same new token on every rank, with no collective.
            self._token = hashlib.blake2b(f"{self._token}/rolled-back".encode(), digest_size=4).hexdigest()
        t0 = time.time()
        # The driver's decision is for the attempt's resume: the first restore of the process,
        # before any save of it, by any Checkpointer (later, a rollback may find newer ones).
        decision = take_decision(self.root)
        if decision is not None and decision.step is None:
            self._restored(None, t0)
            return None
        step = decision.step if decision is not None else None
        if decision is None and self.rank == 0:  # the other ranks wait in the choice's broadcast
            self._wait_for_dead_uploads()
        # The own node-local data file of the likely pick, checked while rank 0 chooses.
        guess = LocalGuess(self.staging, self.rank, step)
        try:
            info = choose_and_load(
                state,
                root=self.root,
                staging=self.staging,
                rank=self.rank,
                world_size=self.world_size,
                policy=self._retry,
                verify_checksums=self.verify_checksums,
                step=step,
                guess=guess,
            )
        finally:
            guess.close()  # a guess the load did not take
        if info is None:
            self._restored(None, t0)
            return None
        self.last_restore = info
        # A Recovery pins its own choice; the step loaded instead of it (the decided one was
        # damaged, every rank fell back) is pinned here, as a restore's own choice is.
        if self.rank == 0 and (decision is None or decision.step != info.step):
            self._pin_resume(info.step)
        self._restored(info.step, t0)
        self._last_step = info.step
        return info.step

    def _wait_for_dead_uploads(self) -> None:
        """Rank 0, before it chooses for itself (no decision: a first attempt, no
        ``Recovery``, or one watching another storage): a dead attempt's saves that its
        workers handed to their node uploaders commit without them; the choice waits for
        those still uploading rather than resume from the commit before and redo the steps
        in between: at most ``RESTORE_UPLOAD_WAIT_S``, or what a ``Recovery`` watching this
        storage said (its ``upload_wait_s``). Only under Ray, where node uploaders run."""
        bound = restore_upload_wait_s(self.root, RESTORE_UPLOAD_WAIT_S)
        if bound <= 0 or not ray_initialized():
            return
        start = time.monotonic()
        try:
            left = wait_for_uploads(self.root, above=None, timeout_s=bound)
        except Exception as exc:  # noqa: BLE001 - the wait only improves the choice; never fails the restore
            logger.warning("could not ask the node uploaders what they still upload: %s", exc)
            return
        waited = time.monotonic() - start
        if left:
            logger.warning("restore: saves still uploading after %.0f s are not waited for: %s", waited, left)
        elif waited >= 0.5:
            logger.info("restore waited %.1f s for saves still uploading in the node uploaders", waited)

    def _restored(self, step: int | None, t0: float) -> None:
        now = time.time()
        self._recorder.restored(step, t0, now)
        self._outcomes.restored(step, now)

    def _pin_resume(self, step: int) -> None:
        """Rank 0: record the resume step for retention (see ``pin_resume``) in the
        background, once this attempt's generation claim landed; storage writes the
        restore need not wait for (``close`` does)."""
        claim, known = self._early_claim, self._generation
        if self._pinning is not None:  # an earlier restore's pin lands first
            self._pinning.join(_DROP_JOIN_S)

        def pin() -> None:
            attempt = known if known is not None else claim.result()[0] if claim is not None else None
            if attempt is None:  # the claim failed already; the first save claims again
                logger.warning("step %d is not pinned for retention: this attempt has no generation yet", step)
                return
            _lineage.pin_resume(self.root, attempt=attempt, step=step)

        self._pinning = threading.Thread(
            target=_best_effort, name="rg-resume-pin", daemon=True, args=("pinning the resume step", pin)
        )
        self._pinning.start()

    # ---- lifecycle ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

    def close(self) -> None:
        """Wait for every save (raising its error, if any, on every rank), then release
        threads and arenas."""
        if self._closed:
            return
        self._recorder.end()
        try:
            reports = self._outcomes.reports
            self.wait()
            if self._ctx.in_ray_train and self._outcomes.reports == reports:
                # The goodput callback must see the end: a report after it, and only one
                # (each is a barrier of every worker). Every rank agrees on what was reported.
                report_closed(self._last_step)
            # Only on a clean close: an error on its way up (a restart coming) is not held
            # back; the restarted worker's Checkpointer deletes what is left.
            self._dropper.join(_DROP_JOIN_S)
            if self._pinning is not None:
                self._pinning.join(_DROP_JOIN_S)
            if self._early_claim is not None:  # never awaited: no save in this Checkpointer
                self._early_claim.join(_DROP_JOIN_S)
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        self._arenas.stop_watching_steps()
        try:
            if self._uploader is not None:
                self._uploader.close()
        finally:
            self._arenas.close()  # jobs that accepted a snapshot keep their own mapping

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Unwinding an error: no collectives (the other ranks may be elsewhere and would
        # hang), no end-of-run record; release what this process holds and re-raise.
        self._release()
