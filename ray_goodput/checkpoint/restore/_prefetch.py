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
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ray_goodput.checkpoint.restore._mmap import MappedFile
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
        self._stops: dict[str, Callable[[], None]] = {}
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

    def adopt(self, name: str, future: concurrent.futures.Future[Early | None], stop: Callable[[], None]) -> None:
        """Take ``future``, started elsewhere, as the early fetch of ``name`` (see
        ``_local_precheck``); ``stop`` ends its work early when nobody takes it."""
        self._reserved[name] = 0
        self._futures[name] = future
        self._stops[name] = stop

    def reserved(self, name: str) -> int:
        return self._reserved.get(name, 0)

    def take(self, name: str, where: str) -> Early | None:
        """Wait for ``name``'s fetch and forget it: what it found (None: the caller reads
        the file its own way), or what it raised. ``where`` names the file in errors."""
        future = self._futures.pop(name)
        self._reserved.pop(name, None)
        self._stops.pop(name, None)
        try:
            return future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(close_result)
            raise StorageError(
                f"reading {where} (started early) did not finish in {self._timeout_s:.0f} s; "
                "check that the storage answers, or restore with a shorter RetryPolicy"
            ) from None

    def drop(self, readers: Countdown | None = None) -> int:
        """Forget the fetches nobody took: stop or cancel what can be, close what they
        mapped once they end, and hold ``readers`` (the guard of the mappings: nothing may
        remove its marker while a fetch still reads one) until each has ended. Returns
        the bytes they had reserved."""
        for name, future in self._futures.items():
            stop = self._stops.get(name)
            if stop is not None:
                stop()  # an adopted one resolves once its work has stopped
            else:
                future.cancel()  # one the pool has not started
            let_go = readers.hold() if readers is not None else None
            future.add_done_callback(functools.partial(close_result, let_go=let_go))
        self._futures.clear()
        self._stops.clear()
        reserved = sum(self._reserved.values())
        self._reserved.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        return reserved


class Countdown:
    """Runs ``then`` once, when it is armed and every :meth:`hold` was let go."""

    def __init__(self, then: Callable[[], None]) -> None:
        self._then = then
        self._held = 0
        self._armed = False
        self._lock = threading.Lock()

    def hold(self) -> Callable[[], None]:
        """A hold; call what it returns (once) to let go."""
        with self._lock:
            self._held += 1
        return self._let_go

    def _let_go(self) -> None:
        with self._lock:
            self._held -= 1
            fire = self._armed and self._held == 0
        if fire:
            self._then()

    def arm(self) -> None:
        with self._lock:
            self._armed = True
            fire = self._held == 0
        if fire:
            self._then()


def close_result(future: concurrent.futures.Future[Early | None], *, let_go: Callable[[], None] | None = None) -> None:
    """Close what a fetch nobody took mapped, once it ended; then ``let_go``."""
    try:
        if future.cancelled() or future.exception() is not None:
            return
        got = future.result()
        if got is not None and isinstance(got.content, MappedFile):
            got.content.close()
    finally:
        if let_go is not None:
            let_go()
