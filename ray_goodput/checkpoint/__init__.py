"""Checkpointing: sharded DCP saves, committed by a manifest written last."""

from ray_goodput.checkpoint._catalog import CheckpointInfo, list_checkpoints, verify
from ray_goodput.checkpoint._retention import apply_retention
from ray_goodput.checkpoint._checkpointer import Checkpointer, SaveStats
from ray_goodput.checkpoint._manifest import Manifest
from ray_goodput.checkpoint._restore import RestoreInfo

__all__ = ["CheckpointInfo", "Checkpointer", "Manifest", "RestoreInfo", "SaveStats",
           "apply_retention", "list_checkpoints", "verify"]
