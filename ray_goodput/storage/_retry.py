"""Retry with exponential backoff for transient storage errors."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ray_goodput.errors import ConfigError, StorageError

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Messages of errors that no retry will fix (pyarrow maps AWS/GCS errors to OSError).
_PERMANENT_MARKERS = (
    "ACCESS_DENIED",
    "AccessDenied",
    "INVALID_ACCESS_KEY",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NoSuchBucket",
    "NO_SUCH_BUCKET",
    "Forbidden",
    "PERMISSION_DENIED",
    "HTTP status 403",
    "HTTP status 404",
    "No space left on device",
)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, 5xx, throttling, connection resets."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, StorageError):
        return False
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        text = str(exc)
        return not any(marker in text for marker in _PERMANENT_MARKERS)
    return False


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
        """Run ``fn``; retry transient errors; raise StorageError naming ``what`` at the end."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                if not is_transient(exc) or attempt == self.attempts:
                    if isinstance(exc, StorageError):
                        raise
                    raise StorageError(
                        f"{what} failed after {attempt} attempt(s): {type(exc).__name__}: {exc}"
                    ) from exc
                pause = self.delay(attempt)
                logger.warning("%s failed (%s); retry %d/%d in %.2fs",
                               what, exc, attempt, self.attempts - 1, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")
