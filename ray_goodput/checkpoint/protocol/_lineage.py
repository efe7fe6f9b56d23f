"""Lineage: the order of saves across the attempts of a run (generations), and the resume pin.

Every attempt claims, before its first save, a generation higher than any claimed
before and than the driver's attempt number when a Recovery decided one. Ray Train starts
an attempt only after the previous one's workers are gone, and the claim is written before
any save of the attempt, so a dead attempt's saves (even ones its uploader commits late)
always rank below the live attempt's. Each claim is an object of its own
(``CLAIM-g<generation>-<token>``), checked against a listing once written, so claims made
at once (two copies of one job) never share a generation: see :func:`claim`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TypeVar

from ray_goodput.checkpoint.protocol import _layout
from ray_goodput.checkpoint.protocol._catalog import StepDir, checkpoints_location, list_checkpoints
from ray_goodput.errors import StorageError
from ray_goodput.runtime import WorkerContext
from ray_goodput.runtime._resume import resume_decision
from ray_goodput.storage import RetryPolicy, StorageLocation, delete_file, list_dir, read_bytes, touch, write_bytes

logger = logging.getLogger(__name__)

#: Bound on waiting for an early claim (its storage requests have their own bounds).
CLAIM_TIMEOUT_S = 600.0
#: How long a claim may go on losing to claims made at the same moment before it gives up.
CLAIM_CONTENTION_S = 120.0
_POLICY = RetryPolicy()
_ONE_TRY = RetryPolicy(attempts=1)
T = TypeVar("T")


def next_generation(
    root: StorageLocation, attempt: int | None, policy: RetryPolicy = _POLICY, *, claimed: int | None = None
) -> int:
    """The generation the next claim gets: above every one claimed under ``root`` (a root
    reused across runs keeps counting; ``claimed``: that highest one, read already), and at
    least the driver's ``attempt``."""
    if claimed is None:
        claimed = claimed_generation(root, policy)
    return max(claimed + 1, attempt or 0)


@dataclass(frozen=True)
class Claim:
    """Who claimed a generation: the process of rank 0 of that attempt (``GENERATION``)."""

    generation: int
    host: str = "?"
    pid: int = 0
    started: float = 0.0  # time.time() of the claim
    run: str = ""  # the Ray Train run's name, when there is one
    token: str = ""  # the claim's token ("": a record of an older ray_goodput)

    def describe(self) -> str:
        if not self.pid:
            return "an owner not on record"
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started)) if self.started else "?"
        return f"pid {self.pid} on host {self.host} at {when}" + (f" (Ray Train run {self.run})" if self.run else "")


def claim(
    root: StorageLocation,
    attempt: int | None,
    policy: RetryPolicy = _POLICY,
    *,
    claimed: int | None = None,
    token: str | None = None,
) -> int:
    """Claim and return this attempt's generation (rank 0 only), naming this process as its
    owner (a run fenced by it names it: ``read_claim``); ``token``: drawn by the caller (the
    attempt's save ids start with it), else here.

    The claim is written as an object of its own, ``CLAIM-g<generation>-<token>``, then
    ``checkpoints/`` is listed. A claim that finds another one at or above its generation
    loses: it withdraws its record and claims again above every claim it saw, backing off
    (for up to ``CLAIM_CONTENTION_S``). A claim that wins listed after its own write, so of
    two claims of one generation, the one that listed later saw the other's record and
    lost: no two claims win the same generation, however they interleave (a store whose
    listings show every object written before them: S3, GCS, a local file system; not
    NFS). Only then is ``GENERATION`` written, the fast path for the next claim's read.
    """
    token = token or uuid.uuid4().hex[:8]
    loc = checkpoints_location(root)
    generation = next_generation(root, attempt, policy, claimed=claimed)
    deadline = time.monotonic() + CLAIM_CONTENTION_S
    lost = 0
    while True:
        record = {
            "generation": generation,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "run": _run_dir(),
            "token": token,
        }
        data = json.dumps(record).encode()
        name = _layout.claim_record(generation, token)
        write_bytes(loc, name, data, policy)  # first: GENERATION's owner is on record
        rivals = [g for g, t in _listed(root, _layout.claim_of, policy) if g >= generation and t != token]
        if not rivals:
            write_bytes(loc, _layout.GENERATION, data, policy)
            return generation
        try:
            delete_file(loc, name, policy)
        except OSError as exc:  # a stale claim only makes later claims count higher
            logger.warning("could not withdraw the lost claim %s under %s: %s", name, root.uri, exc)
        lost += 1
        if time.monotonic() > deadline:
            raise StorageError(
                f"claiming a checkpoint generation under {root.uri} lost to other claims {lost} times in "
                f"{CLAIM_CONTENTION_S:.0f} s: many runs or Checkpointers are starting on this storage path at "
                "once; give each run its own storage_path"
            )
        # Claims that lost together spread over the next numbers, and back off: each round
        # one of those on a number wins it.
        generation = max(rivals) + 1 + random.randrange(len(rivals))
        logger.info("the generation claim under %s lost to a concurrent claim; claiming %d", root.uri, generation)
        time.sleep(random.uniform(0.0, 0.05 * 2 ** min(lost, 5)))  # up to 1.6 s


def _run_dir() -> str:
    """The Ray Train run directory of this process ("" outside Ray Train)."""
    try:
        root = WorkerContext.detect().run_root
    except Exception:  # noqa: BLE001 - only names the claim's owner
        return ""
    return root.uri if root is not None else ""


def mark_saving(root: StorageLocation, generation: int, policy: RetryPolicy = _POLICY) -> None:
    """Record that the attempt of ``generation`` saves under ``root`` (idempotent)."""
    touch(checkpoints_location(root), _layout.saving_marker(generation), policy)


def newest_saving(root: StorageLocation, policy: RetryPolicy = _POLICY) -> int | None:
    """The highest generation that has saved under ``root`` (``mark_saving``; None: none).
    The fence compares against it, not against the newest claim: a claim that never saves
    (a Checkpointer that only restores) may be above a run that does."""
    return _newest_marked(root, _layout.saving_generation, policy)


def _newest_marked(root: str | StorageLocation, parse: Callable[[str], int | None], policy: RetryPolicy) -> int | None:
    """The highest generation of the names under ``<root>/checkpoints`` that ``parse`` reads."""
    return max(_listed(root, parse, policy), default=None)


def _listed(root: str | StorageLocation, parse: Callable[[str], T | None], policy: RetryPolicy) -> list[T]:
    """What ``parse`` reads from the names under ``<root>/checkpoints`` (one listing; the
    names it reads None from left out)."""
    found = [parse(info.base_name) for info in list_dir(checkpoints_location(root), policy=policy)]
    return [f for f in found if f is not None]


def read_claim(
    root: str | StorageLocation, policy: RetryPolicy = _POLICY, *, generation: int | None = None
) -> Claim | None:
    """The newest claim under ``root`` with its owner, or ``generation``'s (None: none, or
    unreadable). A generation claimed before its owner record was kept (an older
    ray_goodput) is found only while ``GENERATION`` still names it."""
    if generation is not None:
        try:
            found = _read_won_claim(root, generation, policy)
        except OSError as exc:  # GENERATION may still name it
            logger.warning("could not read the claim record of generation %d: %s", generation, exc)
            found = None
        if found is not None:
            return found
    newest = _read_claim_file(root, _layout.GENERATION, policy)
    if generation is not None and (newest is None or newest.generation != generation):
        return None
    return newest


def _read_won_claim(root: str | StorageLocation, generation: int, policy: RetryPolicy) -> Claim | None:
    """The record of the claim that won ``generation``. A claim that lost withdraws its
    record; when that failed, ``GENERATION`` names the winner while it is still the newest."""
    tokens = sorted(t for g, t in _listed(root, _layout.claim_of, policy) if g == generation)
    if len(tokens) > 1:
        newest = _read_claim_file(root, _layout.GENERATION, policy)
        if newest is not None and newest.generation == generation and newest.token in tokens:
            tokens = [newest.token]
    for token in tokens:
        found = _read_claim_file(root, _layout.claim_record(generation, token), policy)
        if found is not None:
            return found
    return None


def _read_claim_file(root: str | StorageLocation, name: str, policy: RetryPolicy) -> Claim | None:
    try:
        data = json.loads(read_bytes(checkpoints_location(root), name, policy))
        return Claim(
            generation=int(data["generation"]),
            host=str(data.get("host", "?")),
            pid=int(data.get("pid", 0)),
            started=float(data.get("started", 0.0)),
            run=str(data.get("run", "")),
            token=str(data.get("token", "")),
        )
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return None


def claim_attempt(
    root: StorageLocation, policy: RetryPolicy = _POLICY, *, claimed: int | None = None
) -> tuple[int, str]:
    """Rank 0: claim the generation of this attempt (the driver's Recovery decision, when
    there is one, names the attempt) and draw the token that, with the step, names every
    save of it."""
    decision = resume_decision(root)
    token = uuid.uuid4().hex[:8]
    generation = claim(root, decision.attempt if decision is not None else None, policy, claimed=claimed, token=token)
    return generation, token


class EarlyClaim:
    """Rank 0's :func:`claim_attempt`, started when the Checkpointer is made: its storage
    requests overlap the storage probe and the model's set-up instead of blocking the
    first save or restore, which then only waits for the result (and broadcasts it).

    The read of the highest claimed generation goes out at once, beside the probe (one
    try: a failed one is made again, with retries, after the probe); the write waits for
    :meth:`probed`, and :meth:`abandon` (the probe failed) ends the claim without writing
    to storage found unusable."""

    def __init__(self, root: StorageLocation, policy: RetryPolicy) -> None:
        self._root, self._policy = root, policy
        self._future: Future[tuple[int, str]] = Future()
        self._gate = threading.Event()
        self._abandoned = False
        threading.Thread(target=self._run, name="rg-generation-claim", daemon=True).start()

    def probed(self) -> None:
        """The storage probe passed: write the claim."""
        self._gate.set()

    def abandon(self) -> None:
        """The Checkpointer was not made: claim nothing."""
        self._abandoned = True
        self._gate.set()

    def _run(self) -> None:
        try:
            try:
                claimed: int | None = claimed_generation(self._root, _ONE_TRY)
            except Exception:  # noqa: BLE001 - read again after the probe, with retries
                claimed = None
            self._gate.wait(CLAIM_TIMEOUT_S)  # a probe still running then has not failed: claim
            if self._abandoned:
                raise StorageError(f"no generation claimed under {self._root.uri}: the Checkpointer was not made")
            self._future.set_result(claim_attempt(self._root, self._policy, claimed=claimed))
        except BaseException as exc:  # noqa: BLE001 - raised by result(), on the caller's thread
            self._future.set_exception(exc)

    def result(self) -> tuple[int, str]:
        """``(generation, token)``, or what the claim raised."""
        try:
            return self._future.result(timeout=CLAIM_TIMEOUT_S)
        except FutureTimeout:
            raise StorageError(
                f"claiming a checkpoint generation under {self._root.uri} did not finish in "
                f"{CLAIM_TIMEOUT_S:.0f} s; check that the storage answers"
            ) from None

    def join(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the claim to end, whatever its outcome: a
        Checkpointer that never saved must not leave it writing after ``close``."""
        try:
            self._future.exception(timeout=timeout_s)
        except FutureTimeout:
            logger.warning(
                "claiming a checkpoint generation under %s still runs after %.0f s", self._root.uri, timeout_s
            )


def claimed_generation(root: str | StorageLocation, policy: RetryPolicy = _POLICY) -> int:
    """The highest generation claimed under ``root`` (0 when none). Without a readable
    ``GENERATION`` (lost, or damaged), what the claim records, the saving markers and the
    commits say: a claim below a generation that saved would be fenced at its first save."""
    try:
        data = read_bytes(checkpoints_location(root), _layout.GENERATION, policy)
        return int(json.loads(data)["generation"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        commits = max((i.generation or 0 for i in list_checkpoints(root)), default=0)
        return max(commits, _newest_marked(root, _layout.marked_generation, policy) or 0)


def pin_resume(root: str | StorageLocation, *, attempt: int, step: int) -> None:
    """Record that the attempt of generation ``attempt`` (or higher) resumes from ``step``:
    retention never deletes that checkpoint while no such attempt has a commit, even when
    a dead attempt's uploader commits newer ones late and prunes to ``keep_last``."""
    write_bytes(checkpoints_location(root), _layout.RESUME, json.dumps({"attempt": attempt, "step": step}).encode())


def live_pin(root: str | StorageLocation, found: list[StepDir]) -> int | None:
    """The step the live attempt resumes from (see :func:`pin_resume`), while it matters:
    once that attempt (or a later one) has an intact commit of its own, it is the newer
    recovery point and the pin lapses."""
    try:
        pin = json.loads(read_bytes(checkpoints_location(root), _layout.RESUME))
        attempt, step = int(pin["attempt"]), int(pin["step"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        logger.warning("unreadable %s under %s: no checkpoint is pinned", _layout.RESUME, root)
        return None
    lapsed = any(d.intact and d.manifest.generation >= attempt for d in found)
    return None if lapsed else step
