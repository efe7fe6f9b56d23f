"""Early fetches: a rank's own files read (or checked) in the background while DCP plans.

At an unchanged world size and state structure a rank reads its own data file and RNG
blob whole. Their read starts when the restore begins, and DCP's read of them takes the
result (or raises what the fetch raised), so the read overlaps the metadata read and
DCP's planning collectives. A fetch nobody takes (the load failed first) is dropped: what
it mapped is closed when it ends; a read still in flight finishes in the background (its
storage requests are bounded by the retry policy) and its bytes are then freed.
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ray_goodput.checkpoint._mapped import MappedFile
from ray_goodput.errors import StorageError

#: Bound on waiting for a file fetched early (each request has its own bounds and retries).
EARLY_TIMEOUT_S = 900.0


class Found(enum.Enum):
    LOCAL = "the node-local copy, intact, mapped"
    STORED = "a file of local storage, checked, mapped"
    HELD = "a file of object storage, read whole and checked"
    LOCAL_DAMAGED = "the node-local copy failed its check; storage was not read"


@dataclass(frozen=True)
class Early:
    """What an early fetch found."""

    found: Found
    content: MappedFile | bytes | None = None


class EarlyFetches:
    """The early fetches of one load, by file name, with the bytes of the hold budget
    each reserved (for a read into memory)."""

    def __init__(self, timeout_s: float = EARLY_TIMEOUT_S) -> None:
        self._futures: dict[str, concurrent.futures.Future[Early | None]] = {}
        self._reserved: dict[str, int] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._timeout_s = timeout_s

    def __contains__(self, name: object) -> bool:
        return name in self._futures

    def __len__(self) -> int:
        return len(self._futures)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._futures))

    def start(self, name: str, fetch: Callable[[], Early | None], reserved: int) -> None:
        """Run ``fetch`` in the background (it must touch no state of the reader)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rg-restore-early")
        self._reserved[name] = reserved
        self._futures[name] = self._pool.submit(fetch)

    def adopt(self, name: str, future: concurrent.futures.Future[Early | None]) -> None:
        """Take ``future``, started elsewhere, as the early fetch of ``name`` (see
        ``_local_guess``)."""
        self._reserved[name] = 0
        self._futures[name] = future

    def reserved(self, name: str) -> int:
        return self._reserved.get(name, 0)

    def take(self, name: str, where: str) -> Early | None:
        """Wait for ``name``'s fetch and forget it: what it found (None: the caller reads
        the file its own way), or what it raised. ``where`` names the file in errors."""
        future = self._futures.pop(name)
        self._reserved.pop(name, None)
        try:
            return future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(_close_result)
            raise StorageError(f"reading {where} (started early) did not finish in {self._timeout_s:.0f} s; "
                               "check that the storage answers, or restore with a shorter RetryPolicy") from None

    def drop(self) -> int:
        """Forget the fetches nobody took (closing what they mapped once they end); returns
        the bytes they had reserved."""
        for future in self._futures.values():
            future.add_done_callback(_close_result)
        self._futures.clear()
        reserved = sum(self._reserved.values())
        self._reserved.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        return reserved


def _close_result(future: concurrent.futures.Future[Early | None]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    got = future.result()
    if got is not None and isinstance(got.content, MappedFile):
        got.content.close()
