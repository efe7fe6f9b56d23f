"""Exceptions raised by ray_goodput.

Every exception derives from :class:`GoodputError` and from the built-in that fits,
so ``except ValueError`` keeps working. Each one is picklable with its message alone
(Ray re-raises them in other processes) and its message says which setting or input
to change.
"""

from __future__ import annotations


class GoodputError(Exception):
    """Base class of every error raised by ray_goodput."""


class ConfigError(GoodputError, ValueError):
    """A setting or argument is invalid; the message names it and the fix."""


class StorageError(GoodputError, OSError):
    """Storage could not be reached, read or written (after retries, where retried)."""


class StorageUnusableError(StorageError):
    """The storage probe at start failed: unreachable endpoint, refused credentials, missing
    bucket or read-only directory. A retry of the run cannot fix it; change the URI or access."""


class StorageUnreachableError(StorageUnusableError):
    """The storage probe failed only with errors an outage also gives (nothing accepting
    connections, timeouts, 5xx, and the errors pyarrow raises untyped, a refusal among
    them). At a run's first start it is raised at once (a wrong endpoint looks the same);
    on a restart that ``Recovery`` announces, only after the probe waited for storage for
    ``RESTART_PROBE_WAIT_S``. Not retried either way."""


class CheckpointError(GoodputError, RuntimeError):
    """A checkpoint could not be saved, committed or restored."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint does not match its manifest (missing, truncated or changed file)."""


class IncompleteSaveError(CheckpointError):
    """A save's files no longer match what its ranks declared durable (one is missing or
    changed, e.g. deleted by retention): it can never commit; the previous committed
    checkpoint stays the recovery point."""


class FencedError(CheckpointError):
    """A newer live run claimed this run's storage path (a second job started on the same
    ``storage_path``, or a zombie of a dead attempt): this run stops saving there. The
    message names the other run (generation, host, pid, start time) and what to do. A
    retry of this run would fence the other one in turn, so it is not retried."""


class RecoveryPointTooOldError(CheckpointError):
    """The newest committed checkpoint is older than ``Checkpointer(max_recovery_point_age_s=...)``:
    saves have been failing (or not committing) for too long. A restart resumes from that
    checkpoint; the message names the age, the storage and the last save error."""


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to restore does not match what the checkpoint holds.

    Retrying the run cannot fix this: change the model/optimizer or point the
    Checkpointer at another storage path.
    """


class DataError(GoodputError, ValueError):
    """The data source or a loader state cannot be used: empty source, a state saved for
    another dataset, a world too large for the dataset. The message names the input to fix."""


class CacheFullError(StorageError):
    """The node cache cannot hold a file: it is larger than the cache capacity, or the disk
    is full even after eviction. Raise ``CacheConfig.capacity_bytes`` or free the disk.
    A StorageError (an OSError) that retries do not fix, so they are not attempted."""


class FileLargerThanCacheError(CacheFullError):
    """A file is larger than the whole node cache (``CacheConfig.capacity_bytes``): no
    eviction makes room for it. Raise the capacity or read it uncached (``cache=None``)."""


class CacheLockTimeoutError(StorageError, TimeoutError):
    """A file's fetch into the node cache waited past its bound for the key's lock: the
    process holding it (named in the message) is stuck mid-download. End that process;
    the next read fetches the file."""


class PeerFailedError(GoodputError, RuntimeError):
    """A worker gave up because of its peers, not its node: none came to its quorum in
    time, or its steps stopped committing (replica mode's ``ReplicaJoinError`` and
    ``ReplicaStepError``). Retryable; ``Recovery`` charges no node for it."""


#: Errors that a restart of the run cannot fix: the message says what to change.
NOT_RETRYABLE: tuple[type[GoodputError], ...] = (
    ConfigError,
    StateMismatchError,
    DataError,
    StorageUnusableError,
    FencedError,
)


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: ``__cause__``/``__context__`` chains and the ``cause``
    attribute by which Ray's task and worker errors carry the user's exception."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        cur = todo.pop()
        if cur is None or any(cur is s for s in seen):
            continue
        seen.append(cur)
        nested = getattr(cur, "cause", None)
        todo += [e for e in (cur.__cause__, cur.__context__, nested) if isinstance(e, BaseException)]
    return seen


def not_retryable(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that a retry cannot fix, classified by type; or None."""
    return next((e for e in causes(exc) if isinstance(e, NOT_RETRYABLE)), None)


def peers_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a :class:`PeerFailedError` (its node is not to blame), itself or
    as the error a Ray wrapper carries (``cause``). Not when one is only in its context:
    an error raised while a worker unwound one is its own."""
    for _ in range(16):  # Ray nests its wrappers a few deep at most
        if isinstance(exc, PeerFailedError):
            return True
        nested = getattr(exc, "cause", None)
        if not isinstance(nested, BaseException):
            return False
        exc = nested
    return False


class NoHealthyNodesError(GoodputError, RuntimeError):
    """The nodes that failed their health check left too little room for the workers at
    ``Recovery(max_failures_per_node=...)`` starts in a row: the message names each node and
    why it failed. Fix the nodes (or the check), or add nodes."""


class InjectedFault(GoodputError, RuntimeError):
    """A fault injected on purpose by ``RAY_GOODPUT_FAULT`` (fault soaks and tests).
    Unset that variable to run without injected faults."""
