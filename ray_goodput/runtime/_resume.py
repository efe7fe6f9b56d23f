"""Worker side of the resume handoff: the step the driver chose for this attempt.

After a failure the driver-side ``Recovery`` picks the resume step once (the newest intact
committed checkpoint) and pushes a :class:`ResumeDecision` into every worker process of the
new worker group *before* the training function starts (Ray Train runs worker-group
callbacks between creating the workers and launching the function). So every rank of an
attempt holds the same decision without listing storage, and a checkpoint that the dead
attempt's uploader commits a moment later cannot make ranks disagree.

The decision is a process-global: a Ray Train worker process lives for exactly one attempt,
so it never carries a stale value into the next one.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ray_goodput.storage import StorageLocation, resolve

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_decision: ResumeDecision | None = None
_decision_taken = False  # a restore of this process loaded it: later ones choose for themselves
_restart = False
_upload_wait: tuple[str, float] | None = None  # (root key, seconds), from the driver's Recovery
_upload_wait_cap: float | None = None  # this process's own bound (replica mode)


@dataclass(frozen=True)
class ResumeDecision:
    """What the driver decided for one attempt.

    ``step`` is the checkpoint step to load, or None for "no committed checkpoint: start
    from scratch"; ``generation``, its commit's generation (None when not known). ``root_key``
    names the storage root the decision is about (see :func:`root_key`); a Checkpointer on
    another root must ignore it.
    """

    attempt: int
    step: int | None
    root_key: str
    generation: int | None = None


def root_key(root: str | StorageLocation) -> str:
    """A comparable name of a storage root: filesystem type plus path, without the query
    string (an ``endpoint_override`` spelled differently is still the same bucket)."""
    loc = resolve(root)
    return f"{loc.fs.type_name}:{loc.root.rstrip('/')}"


def set_decision(
    decision: ResumeDecision | None, upload_wait: tuple[str, float] | None = None, *, restart: bool = False
) -> None:
    """Install the driver's decision in this worker process (run by the driver through
    the worker group before the training function starts). ``upload_wait``: ``(root key,
    seconds)``, how long a restore under that root that chooses for itself waits for a dead
    attempt's uploads (see :func:`restore_upload_wait_s`). ``restart``: this process runs
    a later attempt of the run (or a replaced replica), not its first start (see
    :func:`is_restart`)."""
    global _decision, _decision_taken, _upload_wait, _restart  # noqa: PLW0603 - one per worker process, set by the driver
    with _lock:
        _decision, _decision_taken = decision, False
        _upload_wait = upload_wait
        _restart = restart
    if decision is not None:
        logger.info("attempt %d: the driver chose resume step %s", decision.attempt, decision.step)


def is_restart() -> bool:
    """Whether the driver's ``Recovery`` said this process runs a restart of its run (a
    later attempt, or a replaced replica; a later attempt counts even when the one before
    died before it probed storage): a storage probe that fails as an outage does then
    waits for it. False without ``Recovery`` (nothing tells a restart from a first start)."""
    with _lock:
        return _restart


def restore_upload_wait_s(root: str | StorageLocation, default: float) -> float:
    """How long a restore under ``root`` that chooses for itself (no decision) waits for the
    saves a dead attempt's uploaders still upload: what the driver's ``Recovery`` watching
    ``root`` said (its ``upload_wait_s``), else ``default``; at most the cap this process
    set (:func:`cap_restore_upload_wait`)."""
    with _lock:
        told, cap = _upload_wait, _upload_wait_cap
    bound = told[1] if told is not None and told[0] == root_key(root) else default
    return bound if cap is None else min(bound, cap)


def cap_restore_upload_wait(at_most: float | None) -> None:
    """Bound this process's restores to wait at most ``at_most`` seconds for a dead
    attempt's uploads (None: no cap). Replica mode: a restore inside a quorum, whose peers
    wait for it in the step's all-reduce."""
    global _upload_wait_cap  # noqa: PLW0603 - the process's bound, beside the driver's
    with _lock:
        _upload_wait_cap = at_most


def take_decision(root: str | StorageLocation) -> ResumeDecision | None:
    """The driver's decision for the resume of this attempt under ``root``, once: the first
    restore of the process, before it saved (``spend_decision``), takes it; later ones (a
    rollback, another Checkpointer) get None and choose for themselves, as checkpoints may
    have been committed since."""
    global _decision_taken  # noqa: PLW0603 - one decision per worker process
    decision = resume_decision(root)
    with _lock:
        if decision is None or _decision_taken or decision is not _decision:
            return None
        _decision_taken = True
    return decision


def spend_decision() -> None:
    """This process saved: a restore from now on is a rollback, which chooses for itself
    (the decision was for the attempt's resume, and checkpoints may be newer now)."""
    global _decision_taken  # noqa: PLW0603 - one decision per worker process
    with _lock:
        _decision_taken = True


def resume_decision(root: str | StorageLocation | None = None) -> ResumeDecision | None:
    """The driver's decision for this attempt, or None when no Recovery decided (the first
    attempt, or no Recovery in the run): then the caller finds the checkpoint itself.

    With ``root``, a decision made for another storage root is ignored (with a warning):
    it says nothing about checkpoints under ``root``.
    """
    with _lock:
        decision = _decision
    if decision is None or root is None:
        return decision
    if decision.root_key != root_key(root):
        logger.warning(
            "the driver chose a resume step for %s, not for %s; pass the same "
            "storage_path to Recovery and Checkpointer",
            decision.root_key,
            root_key(root),
        )
        return None
    return decision
