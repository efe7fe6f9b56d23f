"""Bounded waits for tests: poll a condition, fail naming what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], *, timeout_s: float, what: str,
             interval_s: float = 0.05) -> T:
    """Call ``condition`` until it returns something truthy, and return that.

    Raises ``TimeoutError`` naming ``what`` after ``timeout_s``: a test waiting on an
    outside event (a file, an actor, a commit) never hangs and says what never came.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def wait_for_file(path: str | Path, *, timeout_s: float, what: str | None = None) -> Path:
    """Wait until ``path`` exists (a marker file another process writes); returns it."""
    path = Path(path)
    wait_for(path.exists, timeout_s=timeout_s, what=what or f"file {path}")
    return path
