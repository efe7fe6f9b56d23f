"""Exceptions raised by ray_goodput.

Every exception derives from :class:`GoodputError` and from the built-in that fits,
so ``except ValueError`` keeps working. Each one is picklable with its message alone
(Ray re-raises them in other processes) and its message says which setting or input
to change.
"""

from __future__ import annotations


class GoodputError(Exception):
    """Base class of every error raised by ray_goodput."""


class ConfigError(GoodputError, ValueError):
    """A setting or argument is invalid; the message names it and the fix."""


class StorageError(GoodputError, OSError):
    """Storage could not be reached, read or written (after retries, where retried)."""


class CheckpointError(GoodputError, RuntimeError):
    """A checkpoint could not be saved, committed or restored."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint does not match its manifest (missing, truncated or changed file)."""


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to restore does not match what the checkpoint holds.

    Retrying the run cannot fix this: change the model/optimizer or point the
    Checkpointer at another storage path.
    """
