"""A restore's collective loop: rank 0 chooses a committed checkpoint, every rank loads it.

A pick found damaged is quarantined (by rank 0) and every rank falls back to the previous
intact one; a pick that left storage while it was loaded (a dead attempt's uploader pruned
it) is chosen again, a bounded number of times. Every rank takes the same branch: the
choice, the load's outcome and the verdict on a failed load are agreed.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from ray_goodput.checkpoint.protocol import _collective
from ray_goodput.checkpoint.protocol._manifest import Manifest
from ray_goodput.checkpoint.restore._load import RestoreInfo, choose, failed_load_verdict, load_checkpoint
from ray_goodput.checkpoint.restore._local_precheck import LocalGuess
from ray_goodput.errors import CheckpointError, StateMismatchError
from ray_goodput.storage import RetryPolicy, StorageLocation

logger = logging.getLogger(__name__)

#: How many times one restore chooses again after its pick left storage during the load.
_CHOICES_AFTER_GONE = 3


def choose_and_load(
    state: dict[str, Any],
    *,
    root: StorageLocation,
    staging: Path,
    rank: int,
    world_size: int,
    policy: RetryPolicy,
    verify_checksums: bool,
    step: int | None,
    guess: LocalGuess,
) -> RestoreInfo | None:
    """Collective: load ``step`` (None: the newest intact committed checkpoint) into
    ``state`` in place; None when there is none to load.

    Rank 0's choice does not wait for the attempt's generation claim. A pick that a dead
    attempt's uploader prunes during the load is chosen again (``failed_load_verdict``;
    docs/design/restore.md). ``guess``: this rank's node-local guess of the pick (rank
    0's hints the choice). Raises StateMismatchError when ``state`` does not fit (no other
    checkpoint would), the load's own error when it failed for another reason, and
    CheckpointError when picks kept leaving storage, or the driver's ``step`` and every
    intact one below it are gone (``choose``: never a fresh start for want of them).
    """
    before: tuple[int, int] | None = None
    gone = 0
    load = functools.partial(
        load_checkpoint, root=root, staging=staging, rank=rank, world_size=world_size, policy=policy, guess=guess
    )
    while True:
        manifest = _collective.on_rank0(
            functools.partial(choose, root, step=step, before=before, checksums=verify_checksums, hint=guess.step),
            "choosing the checkpoint to restore",
        )
        if manifest is None and gone:  # never start fresh for want of a pick that left
            raise CheckpointError(
                "the checkpoint chosen to restore left storage while it was loaded, and none is "
                "left to fall back to within this attempt's bounds; restart the attempt (a new "
                "restore chooses among the commits made since)"
            )
        if manifest is None:
            return None
        try:
            # Collective: every rank loads it or raises the same error (agreed in load_checkpoint).
            return load(state, manifest=manifest)
        except StateMismatchError:
            raise  # the state passed in does not fit: no other checkpoint would
        except Exception as exc:  # every rank alike: agreed in load_checkpoint
            verdict = _collective.on_rank0(
                functools.partial(failed_load_verdict, root, manifest, exc),
                "checking the checkpoint whose load failed",
            )
            if verdict == "damaged":  # quarantined by rank 0: every rank falls back
                logger.warning("checkpoint step %d is damaged (%s); falling back", manifest.step, exc)
                before = manifest.order
                continue
            if verdict == "failed":
                raise  # the load's own error
            gone += 1
            _choose_again(manifest, exc, gone)


def _choose_again(manifest: Manifest, exc: Exception, gone: int) -> None:
    """The pick left storage while it was loaded (``gone`` times now): choose again, or
    raise CheckpointError once that kept happening."""
    if gone > _CHOICES_AFTER_GONE:  # gone again and again: say so, do not loop
        raise CheckpointError(
            f"the checkpoint chosen to restore left storage while it was loaded {gone} times "
            f"(the last: step {manifest.step}, {type(exc).__name__}: {exc}); another process is pruning "
            "this storage path (a dead attempt's uploader, or another run on it): restart the attempt, "
            "and give each run its own storage_path"
        ) from exc
    logger.warning("checkpoint step %d left storage while it was loaded (%s); choosing again", manifest.step, exc)
