"""ray_goodput: fast, fault-tolerant PyTorch training on Ray Train.

The public names below are imported on first use (PEP 562), so ``import ray_goodput.storage``
or the ``ray-goodput ls`` command do not pay for torch, Ray Train and MLflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_goodput._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "CheckpointInfo": "ray_goodput.checkpoint",
    "Checkpointer": "ray_goodput.checkpoint",
    "Manifest": "ray_goodput.checkpoint",
    "RestoreInfo": "ray_goodput.checkpoint",
    "list_checkpoints": "ray_goodput.checkpoint",
    "GoodputCallback": "ray_goodput.driver",
    "Recovery": "ray_goodput.driver",
    "TorchTrainer": "ray_goodput.driver",
    "ReplicaGroups": "ray_goodput.replica",
    "record_end": "ray_goodput.goodput",
    "record_step": "ray_goodput.goodput",
    "CacheFullError": "ray_goodput.errors",
    "CacheLockTimeoutError": "ray_goodput.errors",
    "FileLargerThanCacheError": "ray_goodput.errors",
    "CheckpointCorruptError": "ray_goodput.errors",
    "CheckpointError": "ray_goodput.errors",
    "ConfigError": "ray_goodput.errors",
    "DataError": "ray_goodput.errors",
    "FencedError": "ray_goodput.errors",
    "GoodputError": "ray_goodput.errors",
    "IncompleteSaveError": "ray_goodput.errors",
    "NoHealthyNodesError": "ray_goodput.errors",
    "PeerFailedError": "ray_goodput.errors",
    "RecoveryPointTooOldError": "ray_goodput.errors",
    "StateMismatchError": "ray_goodput.errors",
    "StorageError": "ray_goodput.errors",
    "StorageUnreachableError": "ray_goodput.errors",
    "StorageUnusableError": "ray_goodput.errors",
}

__all__ = sorted(_EXPORTS)


#: subpackages reachable as attributes (``ray_goodput.data.DataLoader`` after ``import ray_goodput``)
_SUBPACKAGES = frozenset(
    {"checkpoint", "cli", "data", "driver", "errors", "goodput", "plan", "replica", "runtime", "storage", "testing"}
)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBPACKAGES)


if TYPE_CHECKING:
    from ray_goodput.checkpoint import Checkpointer, CheckpointInfo, Manifest, RestoreInfo, list_checkpoints
    from ray_goodput.driver import GoodputCallback, Recovery, TorchTrainer
    from ray_goodput.errors import (
        CacheFullError,
        CacheLockTimeoutError,
        CheckpointCorruptError,
        CheckpointError,
        ConfigError,
        DataError,
        FencedError,
        FileLargerThanCacheError,
        GoodputError,
        IncompleteSaveError,
        NoHealthyNodesError,
        PeerFailedError,
        RecoveryPointTooOldError,
        StateMismatchError,
        StorageError,
        StorageUnreachableError,
        StorageUnusableError,
    )
    from ray_goodput.goodput import record_end, record_step
    from ray_goodput.replica import ReplicaGroups
