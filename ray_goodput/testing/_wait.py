"""Bounded waits for tests: poll a condition, fail naming what was awaited."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], *, timeout_s: float, what: str, interval_s: float = 0.05) -> T:
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


def publish_file(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` for a :func:`wait_for_file` in another process.

    The file appears whole or not at all (written beside it, then renamed): a reader that
    opens it as soon as it exists never sees it empty or cut short.
    """
    path = Path(path)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(text)
    os.replace(part, path)
    return path


def wait_for_file(path: str | Path, *, timeout_s: float, what: str | None = None) -> Path:
    """Wait until ``path`` exists (a marker file another process writes); returns it.

    Read what it holds only if the writer used :func:`publish_file`: a plain write can be
    seen between the file's creation and its last byte.
    """
    path = Path(path)
    wait_for(path.exists, timeout_s=timeout_s, what=what or f"file {path}")
    return path
