"""ray_goodput: fast, fault-tolerant PyTorch training on Ray Train."""

from ray_goodput.checkpoint import (
    CheckpointInfo,
    Checkpointer,
    Manifest,
    RestoreInfo,
    list_checkpoints,
)
from ray_goodput.goodput import GoodputCallback, record_end, record_step
from ray_goodput.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ConfigError,
    GoodputError,
    StateMismatchError,
    StorageError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "ConfigError",
    "GoodputCallback",
    "GoodputError",
    "Manifest",
    "RestoreInfo",
    "StateMismatchError",
    "StorageError",
    "list_checkpoints",
    "record_end",
    "record_step",
]
