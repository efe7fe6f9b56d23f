"""Export a committed checkpoint as one ``torch.save`` file, for use outside distributed
training (inference, fine-tuning elsewhere, a model hub).

The output is a dict with the top-level keys of the state that was saved, as full
(unsharded) tensors: ``{"model": {fqn: tensor}}``, plus each optimizer entry
(``{"state": {fqn: {...}}, "param_groups": [...]}``, FQN-keyed as DCP's
``get_optimizer_state_dict`` gives it) with ``optim=True``. Plain Python values of the
state are left out (they are pickled objects of the user's classes).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

# Private, as in DCP's own dcp_to_torch_save: dcp.load() cannot fill an empty dict.
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ray_goodput.checkpoint.protocol._catalog import list_checkpoints, newest_valid, step_location, verify
from ray_goodput.checkpoint.protocol._dcp_storage import PyArrowStorageReader
from ray_goodput.checkpoint.protocol._manifest import Manifest, read_manifest
from ray_goodput.checkpoint.save._state_dict import _INTERNAL_PREFIX
from ray_goodput.errors import CheckpointCorruptError, ConfigError, StorageError
from ray_goodput.storage import StorageLocation

__all__ = ["export_torch_save"]


def _pick(uri: str, step: int | None) -> tuple[StorageLocation, Manifest]:
    """The checkpoint to export, its checksums checked: ``step``'s commit, or (None) the
    newest intact one by lineage, as a restore picks it (a dead attempt's late commit of a
    higher step is not the run's newest)."""
    committed = [i.step for i in list_checkpoints(uri) if i.committed]
    if not committed:
        raise ConfigError(
            f"no committed checkpoint under {uri!r}; pass the run's storage root "
            "(the directory that holds checkpoints/), see `ray-goodput ls URI`"
        )
    if step is None:
        found = newest_valid(uri, checksums=True)  # quarantines a damaged one, as a restore does
        if found is None:
            raise ConfigError(
                f"no intact committed checkpoint under {uri!r}: every one is damaged (`ray-goodput verify {uri}`)"
            )
        return found
    if step not in committed:
        raise ConfigError(
            f"no committed checkpoint at step {step} under {uri!r}; committed steps: "
            f"{committed} (`ray-goodput ls {uri}`)"
        )
    loc = step_location(uri, step)
    manifest = read_manifest(loc)
    if manifest is None:
        raise ConfigError(f"checkpoint step {step} under {uri!r} is not committed (retention may have removed it)")
    problems = verify(loc, manifest, checksums=True)
    if problems:
        raise CheckpointCorruptError(
            f"checkpoint step {step} at {loc.uri} is damaged: {'; '.join(problems[:5])}; "
            "export an older step (`ray-goodput ls`)"
        )
    return loc, manifest


def _is_optimizer(key: str, metadata: Metadata) -> bool:
    """An optimizer state dict is the only saved entry with a ``param_groups`` child."""
    return any(
        len(path) > 1 and path[0] == key and path[1] == "param_groups" for path in metadata.planner_data.values()
    )


def _keys_to_export(metadata: Metadata, optim: bool) -> set[str]:
    top = {path[0] for path in metadata.planner_data.values() if path}
    return {k for k in top if not k.startswith(_INTERNAL_PREFIX) and (optim or not _is_optimizer(k, metadata))}


def export_torch_save(uri: str, step: int | None, out: str | os.PathLike, *, optim: bool = False) -> Path:
    """Write the committed checkpoint ``step`` (None: the newest) of the run at ``uri``
    to ``out`` as a single ``torch.save`` file; returns its path.

    ``uri`` is the storage root given to ``Checkpointer`` (any ``pyarrow.fs`` URI). The
    newest is taken by lineage, as a restore takes it. The checkpoint's files are checked
    against its manifest's sizes and checksums first (one more read of every byte).
    Loads the whole model (and optimizer, with ``optim``) into this process's memory.
    Raises ConfigError when there is no such committed checkpoint (or, for the newest,
    no intact one, or ``out`` is a directory), CheckpointCorruptError when ``step``'s does
    not match its manifest, StorageError when storage, or writing ``out``, fails (no
    temporary file is left).
    """
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"{out} is a directory; give the file to write, e.g. {out / 'model.pt'}")
    loc, manifest = _pick(uri, step)
    reader = PyArrowStorageReader(loc)
    keys = _keys_to_export(reader.read_metadata(), optim)
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    for key in manifest.unstepped:  # saved before its first step: DCP made its state up
        if isinstance(state.get(key), dict):
            state[key]["state"] = {}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, out)  # never leave a half-written file under the final name
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
        free = shutil.disk_usage(out.parent).free if out.parent.is_dir() else None
        raise StorageError(
            f"could not write {out} ({free} bytes free there): {type(exc).__name__}: {exc}; "
            "if that disk is full, free space there or choose another path"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)  # the whole model's size, if the write failed
    return out
