"""A rank's own node-local data file checked while rank 0 chooses the checkpoint.

Restoring from the node-local copy, the largest piece of a rank's work is checking its own
data file against the manifest (a pass over the whole file), and before it can start,
rank 0 lists storage and reads the chosen commit (two storage round trips, ~15 ms on the
S3 server, more on a real object store). :class:`LocalGuess` guesses the file while that
runs: in the step the driver decided (``Recovery``), else in the newest step directory of
the node-local copy, the newest save's data file of this rank. It maps the file and
computes its checksum in a background thread. When the choice names that very file (same
step, name and size), the restore takes the mapping and the checksum, and compares the
checksum with the manifest's, so the file is checked once, as before, only earlier. Any
other outcome (another step, a save that never committed, another checksum algorithm)
stops the check at its next chunk and unmaps the file.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ray_goodput.checkpoint import _layout
from ray_goodput.checkpoint._mapped import MapGuard, MappedFile
from ray_goodput.storage import DEFAULT_ALGORITHM, FileEntry, checksum, combine_checksums

logger = logging.getLogger(__name__)

#: Bytes checksummed between two looks at the stop flag.
CHUNK_BYTES = 32 << 20
#: Bound on waiting for the guess's check once the choice named its file (a local pass
#: over a mapped file; beyond this the restore checks the file itself).
TAKE_TIMEOUT_S = 300.0


class LocalGuess:
    """The background check of one guessed node-local file (see the module docstring)."""

    def __init__(self, staging: Path, rank: int, step: int | None) -> None:
        self.step, self.path = _guess(staging, rank, step)
        self._guard: MapGuard | None = None
        self._mapped: MappedFile | None = None
        self._crc: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.path is not None:
            self._guard = MapGuard(self.path.parent)
            self._thread = threading.Thread(target=self._check, args=(self.path, self._guard),
                                            name="rg-restore-guess", daemon=True)
            self._thread.start()

    def _check(self, path: Path, guard: MapGuard) -> None:
        try:
            mapped = guard.map(path)
        except OSError as exc:  # gone meanwhile: the restore finds out its own way
            logger.debug("could not map %s: %s", path, exc)
            return
        if mapped is None:
            return
        self._mapped = mapped
        crc = checksum(b"", DEFAULT_ALGORITHM)
        for offset in range(0, mapped.size, CHUNK_BYTES):
            if self._stop.is_set():
                return
            size = min(CHUNK_BYTES, mapped.size - offset)
            crc = combine_checksums(crc, mapped.checksum(DEFAULT_ALGORITHM, offset, size), size)
        self._crc = crc

    def take(self, step: int, local_dir: Path,
             entries: dict[str, FileEntry]) -> tuple[dict[str, MappedFile], MapGuard | None]:
        """The guessed file's checked mapping ``{name: mapping}`` and the guard of its
        directory's mappings, when the chosen checkpoint (``step``, its node-local
        directory ``local_dir``, its manifest ``entries``) has that file and its checksum
        matches; else ``({}, None)``, the guess dropped. The caller owns what it gets."""
        path = self.path
        want = entries.get(path.name) if path is not None else None
        if self._thread is None or path is None or step != self.step or path.parent != local_dir \
                or want is None or want.algorithm != DEFAULT_ALGORITHM:
            self.close()
            return {}, None
        self._thread.join(TAKE_TIMEOUT_S)
        mapped, crc = self._mapped, self._crc
        if self._thread.is_alive() or mapped is None or crc is None \
                or (mapped.size, crc) != (want.size, want.crc32):
            self.close()  # damaged, cut short, or slow: the restore checks it its own way
            return {}, None
        guard, self._guard, self._mapped, self.path = self._guard, None, None, None
        return {path.name: mapped}, guard

    def close(self) -> None:
        """Stop the check and drop what the guess holds (idempotent)."""
        self.path = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(TAKE_TIMEOUT_S)
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            mapped.close()
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.done()


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
