"""Checkpointing: sharded DCP saves, committed by a manifest written last.

The package reads top-down, one subpackage per role (imports only point down):

- :class:`Checkpointer` (``_checkpointer``): the facade a training loop uses.
- ``restore``: choosing the checkpoint to resume from and reading it into live objects,
  node-local copy first.
- ``uploader``: the node's ``CheckpointUploader`` actor and the shard jobs it runs
  (snapshot -> DCP files -> storage -> commit), and the clients that hand jobs to it.
- ``save``: the worker side of a save: state dict, snapshot arenas, the hand-off.
- ``protocol``: what storage holds and the rules for writing it: layout, manifest,
  commit, lineage (generations), retention, catalog.

The names below are this package's public API (the driver, the CLI and users import them
from here); they load on first use, so importing a subpackage loads only what it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_goodput._lazy import lazy_exports

_EXPORTS = {
    "Checkpointer": "ray_goodput.checkpoint._checkpointer",
    "SaveStats": "ray_goodput.checkpoint._checkpointer",
    "RestoreInfo": "ray_goodput.checkpoint.restore._load",
    "export_torch_save": "ray_goodput.checkpoint.restore._export",
    "CheckpointInfo": "ray_goodput.checkpoint.protocol._catalog",
    "list_checkpoints": "ray_goodput.checkpoint.protocol._catalog",
    "newest_valid": "ray_goodput.checkpoint.protocol._catalog",
    "step_location": "ray_goodput.checkpoint.protocol._catalog",
    "verify": "ray_goodput.checkpoint.protocol._catalog",
    "Manifest": "ray_goodput.checkpoint.protocol._manifest",
    "quarantine": "ray_goodput.checkpoint.protocol._manifest",
    "read_manifest": "ray_goodput.checkpoint.protocol._manifest",
    "next_generation": "ray_goodput.checkpoint.protocol._lineage",
    "pin_resume": "ray_goodput.checkpoint.protocol._lineage",
    "apply_retention": "ray_goodput.checkpoint.protocol._retention",
    "start_node_uploader": "ray_goodput.checkpoint.uploader._calls",
    "uploader_status": "ray_goodput.checkpoint.uploader._calls",
    "wait_for_uploads": "ray_goodput.checkpoint.uploader._calls",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, frozenset({"protocol", "restore", "save", "uploader"}))

if TYPE_CHECKING:
    from ray_goodput.checkpoint._checkpointer import Checkpointer, SaveStats
    from ray_goodput.checkpoint.protocol._catalog import (
        CheckpointInfo,
        list_checkpoints,
        newest_valid,
        step_location,
        verify,
    )
    from ray_goodput.checkpoint.protocol._lineage import next_generation, pin_resume
    from ray_goodput.checkpoint.protocol._manifest import Manifest, quarantine, read_manifest
    from ray_goodput.checkpoint.protocol._retention import apply_retention
    from ray_goodput.checkpoint.restore._export import export_torch_save
    from ray_goodput.checkpoint.restore._load import RestoreInfo
    from ray_goodput.checkpoint.uploader._calls import start_node_uploader, uploader_status, wait_for_uploads
