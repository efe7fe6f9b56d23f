"""Retry with exponential backoff for transient storage errors."""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ray_goodput.errors import ConfigError, GoodputError, StorageError, StorageUnusableError

logger = logging.getLogger(__name__)
T = TypeVar("T")

# OSErrors that no retry fixes, by type or errno. pyarrow raises other storage errors
# (timeouts, 5xx, throttling, resets, and also refusals it does not type) as plain
# OSError: those are retried a bounded number of times, then raised as StorageError.
_PERMANENT_TYPES = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
    StorageError,
)
_PERMANENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EROFS,
        errno.EACCES,
        errno.EDQUOT,
        errno.ENAMETOOLONG,  # the same name is as long on the next try
        errno.ELOOP,
        errno.EFBIG,
        errno.EXDEV,
    }
)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, 5xx, throttling, connection resets."""
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return False
    return isinstance(exc, (OSError, TimeoutError, ConnectionError))


def is_outage(exc: BaseException) -> bool:
    """A storage error that only its retries running out made final (its cause transient):
    the storage may answer again. Not a refusal, a missing file, a full disk, nor the
    probe's verdict (StorageUnusableError)."""
    if not isinstance(exc, StorageError) or isinstance(exc, StorageUnusableError):
        return False
    cause = exc.__cause__
    return cause is not None and is_transient(cause)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How storage operations are retried. Delays are in seconds."""

    attempts: int = 6
    initial_delay: float = 0.2
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_delay < 0 or self.max_delay < self.initial_delay:
            raise ConfigError("RetryPolicy needs 0 <= initial_delay <= max_delay")

    def delay(self, attempt: int) -> float:
        """Backoff before retry number ``attempt`` (1-based), with full jitter."""
        cap = min(self.max_delay, self.initial_delay * (2 ** (attempt - 1)))
        return random.uniform(cap / 2, cap)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; retry transient errors; raise StorageError naming ``what`` at the end.
        A library error (``GoodputError``) that ``fn`` raises is raised as it is."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:  # classified below
                if not is_transient(exc) or attempt == self.attempts:
                    if isinstance(exc, GoodputError):  # the library's own verdict keeps its type
                        raise
                    raise StorageError(
                        f"{what} failed after {attempt} attempt(s): {type(exc).__name__}: {exc}"
                    ) from exc
                pause = self.delay(attempt)
                logger.warning("%s failed (%s); retry %d/%d in %.2fs", what, exc, attempt, self.attempts - 1, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")
