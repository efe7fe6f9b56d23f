"""A rank's own node-local data file checked while rank 0 chooses the checkpoint.

Restoring from the node-local copy, the largest piece of a rank's work is checking its own
data file against the manifest (a pass over the whole file), and before it can start,
rank 0 lists storage and reads the chosen commit (storage round trips: ~15 ms on the S3
server, more on a real object store). :class:`LocalGuess` guesses the file meanwhile: in
the step the driver decided (``Recovery``), else in the newest step directory of the
node-local copy, the newest save's data file of this rank. A thread maps it and computes
its checksum. When the choice names that very file (same step and name) and the rank
will read it whole (the state loads every entry, at the world size that saved it), the
running check becomes one of the load's early fetches (``_prefetch``): the load takes the
mapping if the checksum matches the manifest's and reads storage if not, so the file is
checked once, as before, only earlier. Any other outcome stops the check at its next
chunk and unmaps the file.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from pathlib import Path

from ray_goodput.checkpoint.protocol import _layout
from ray_goodput.checkpoint.restore._mmap import MapGuard, MappedFile
from ray_goodput.checkpoint.restore._prefetch import Early, Found
from ray_goodput.storage import DEFAULT_ALGORITHM, FileEntry, checksum, combine_checksums

logger = logging.getLogger(__name__)

#: Bytes checksummed between two looks at the stop flag.
CHUNK_BYTES = 32 << 20
#: Bound on waiting for a dropped guess's thread to stop (it stops at its next chunk).
STOP_TIMEOUT_S = 60.0

_Checked = tuple[MappedFile, int]  # the mapping and its checksum


class LocalGuess:
    """The background check of one guessed node-local file (see the module docstring)."""

    def __init__(self, staging: Path, rank: int, step: int | None) -> None:
        self.step, self.path = _guess(staging, rank, step)
        self._guard: MapGuard | None = None
        self._result: concurrent.futures.Future[_Checked | None] = concurrent.futures.Future()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.path is None:
            return
        guard = MapGuard(self.path.parent)
        thread = threading.Thread(target=self._run, args=(self.path, guard), name="rg-restore-guess", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to spare: no guess (the restore goes on as before)
            logger.warning("could not start the check of %s ahead of the restore's choice: %s", self.path, exc)
            self.path = None
            return
        self._guard, self._thread = guard, thread

    def _run(self, path: Path, guard: MapGuard) -> None:
        got: _Checked | None = None
        try:
            got = self._check(path, guard)
        except Exception as exc:  # noqa: BLE001 - the load then checks the file its own way
            logger.debug("the check of %s ahead of the choice failed: %s", path, exc)
        finally:  # resolved whatever happened: the load and close() wait on it
            self._result.set_result(got)

    def stop(self) -> None:
        """Stop the check at its next chunk (its result is then None)."""
        self._stop.set()

    def _check(self, path: Path, guard: MapGuard) -> _Checked | None:
        if self._stop.is_set():
            return None
        mapped = guard.map(path)
        if mapped is None:
            return None
        try:
            crc = checksum(b"", DEFAULT_ALGORITHM)
            for offset in range(0, mapped.size, CHUNK_BYTES):
                if self._stop.is_set():
                    mapped.close()
                    return None
                size = min(CHUNK_BYTES, mapped.size - offset)
                crc = combine_checksums(crc, mapped.checksum(DEFAULT_ALGORITHM, offset, size), size)
        except BaseException:
            mapped.close()
            raise
        return mapped, crc

    def take(
        self,
        step: int,
        local_dir: Path,
        entries: dict[str, FileEntry],
        *,
        whole: bool,
    ) -> tuple[str, concurrent.futures.Future[Early | None], MapGuard] | None:
        """``(name, check, guard)`` when the chosen checkpoint (``step``, its node-local
        directory ``local_dir``, its manifest ``entries``) has the guessed file and the
        rank reads it ``whole``: ``check`` gives what an early fetch of it would (the
        checked mapping, or "damaged"), ``guard`` is the guard of that directory's
        mappings; the caller owns both. Else None, the guess dropped."""
        path = self.path
        want = entries.get(path.name) if path is not None else None
        if (
            self._guard is None
            or path is None
            or want is None
            or not whole
            or step != self.step
            or path.parent != local_dir
            or want.algorithm != DEFAULT_ALGORITHM
        ):
            self.close()
            return None
        check: concurrent.futures.Future[Early | None] = concurrent.futures.Future()

        def judged(done: concurrent.futures.Future[_Checked | None]) -> None:
            verdict: Early | None = None  # not mappable, or stopped: the load checks it its own way
            try:
                got = done.result()
                if got is not None and (got[0].size, got[1]) == (want.size, want.crc32):
                    verdict = Early(Found.LOCAL, got[0])
                elif got is not None:
                    got[0].close()
                    verdict = Early(Found.LOCAL_DAMAGED)
            finally:  # a callback's exception is swallowed: the load must not wait on it for ever
                check.set_result(verdict)

        guard, self._guard, self.path = self._guard, None, None
        self._result.add_done_callback(judged)
        return path.name, check, guard

    def close(self) -> None:
        """Stop the check (also a taken one: a load that ended before DCP asked for the file
        no longer needs it) and drop what a guess nobody took holds (idempotent)."""
        self.path = None
        self._stop.set()
        guard, self._guard = self._guard, None
        if guard is None:  # none made, or taken: its new owner drops the rest
            return
        thread = self._thread  # made with the guard
        if thread is not None:
            thread.join(STOP_TIMEOUT_S)
        if thread is not None and thread.is_alive():  # its marker stays: a later restore reads, not maps
            logger.warning(
                "the check of a node-local file ahead of the restore's choice did not stop "
                "within %.0f s; its mapping is dropped when it ends",
                STOP_TIMEOUT_S,
            )
            self._result.add_done_callback(_close_checked)
            return
        _close_checked(self._result)
        guard.done()


def _close_checked(done: concurrent.futures.Future[_Checked | None]) -> None:
    got = done.result()
    if got is not None:
        got[0].close()


def _guess(staging: Path, rank: int, step: int | None) -> tuple[int | None, Path | None]:
    """(step, path) of the data file to guess, or (None, None)."""
    try:
        if step is None:
            steps = [s for s in (_layout.parse_step(p.name) for p in staging.iterdir()) if s is not None]
            if not steps:
                return None, None
            step = max(steps)
        files = list((staging / _layout.step_dir(step)).glob(f"__{rank}_g*.distcp"))
    except OSError:
        return None, None
    if not files:
        return None, None
    return step, max(files, key=lambda p: (_layout.generation_of(p.name) or -1, p.name))
