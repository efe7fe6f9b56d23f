"""Getting a rank's first save ready while it restores.

The first save of each attempt paid what a later save does not: the first touch of every
page of its snapshot arena (a fresh tmpfs mapping: 0.04 s per 72 MiB on this project's
2-core machine, against 0.005 s for a copy into touched pages) and the connection to the
node uploader. ``restore()`` runs on every rank before training and knows the state: it
sizes the arena (:func:`snapshot_size`, from this rank alone: no collective) and leaves
its pages to be touched, and pinned for CUDA when the model is on a GPU, in the
background (:meth:`Arena.prefault`) while the training loop starts; the backend connects
in the background from construction. The owner plan stays with the first save (one
exchange among the ranks): in restore it cost more than it saved there.

Only a state whose optimizers have stepped is sized in ``restore()`` (a resumed attempt's,
or one restored into): describing an optimizer that never stepped means running a made-up
step (``_state_dict.made_up_state``), whose hooks, memory and wrappers (a GradScaler)
``restore()`` must not set off. A fresh start's optimizers get their state at their first
real step: :func:`after_first_steps` sizes the arena then (a post-step hook, once), while
the steps before the first save run. An optimizer whose real step leaves no state (SGD
without momentum) is known from then on to keep none, and needs no made-up step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ray_goodput.checkpoint.protocol import _shard_plan
from ray_goodput.checkpoint.save import _state_dict
from ray_goodput.checkpoint.save._arena import aligned

logger = logging.getLogger(__name__)


def snapshot_size(state: dict[str, Any], world_size: int, rank: int) -> int | None:
    """The bytes this rank's arena needs to snapshot ``state`` as a save sees it, from this
    rank's state alone: its shards, and the replicated leaves the owner plan gives it when
    every rank holds the same ones (else the save grows the arena). None when an optimizer
    has not stepped or the state cannot be described: the save sizes the arena itself."""
    try:
        roles = _state_dict.classify(state)
        if any(_unstepped(optim) for optim, _ in roles.optimizers.values()):
            return None
        with _state_dict.saving(roles) as (sd, _):
            flat, _ = flatten_state_dict(sd)
            leaves = {fqn: _shard_plan.describe(value) for fqn, value in flat.items()}
            sizes = {
                fqn: aligned(_nbytes(value)) for fqn, value in flat.items() if leaves[fqn].kind != _shard_plan.OBJECT
            }
    except Exception as exc:  # noqa: BLE001 - an optimisation: the save itself raises what is wrong
        logger.debug("could not size the first save's arena ahead: %s", exc)
        return None
    mine = _shard_plan.share_when_all_hold(leaves, world_size, rank)
    return sum(sizes[fqn] for fqn in mine if fqn in sizes)


def snapshot_device(state: dict[str, Any]) -> torch.device | None:
    """The CUDA device of the first module parameter in ``state`` that is on a GPU (the
    device a save copies from, for which its arena is pinned); None when none is."""
    try:
        modules = _state_dict.classify(state).modules.values()
        return next((p.device for m in modules for p in m.parameters() if p.device.type == "cuda"), None)
    except Exception:  # noqa: BLE001 - an optimisation: the save pins the arena itself
        return None


def _unstepped(optim: torch.optim.Optimizer) -> bool:
    """An optimizer with no state yet that will have some after its first step (describing
    it means a made-up step)."""
    return not optim.state and not _state_dict.keeps_no_state(optim)


def _nbytes(value: Any) -> int:
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.numel() * local.element_size()


def after_first_steps(state: dict[str, Any], ready: Callable[[], None]) -> list[RemovableHandle]:
    """Call ``ready()`` once, right after the optimizers of ``state`` that hold no state yet
    have all stepped (a post-step hook on each). Returns the hooks' handles, for the
    caller to remove (a save or restore runs made-up steps first; [] when no optimizer
    waits): a hook cannot remove itself, since ``step()`` is iterating over the hooks
    then and a later one would meet a dict changed under it. ``ready`` must not raise
    (it runs inside ``optimizer.step()``)."""
    try:
        optimizers = _state_dict.classify(state).optimizers.values()
        waiting = [optim for optim, _ in optimizers if _unstepped(optim)]
    except Exception:  # noqa: BLE001 - the save itself raises what is wrong with the state
        return []
    fired = False

    def stepped(optim: torch.optim.Optimizer, *_: Any) -> None:
        nonlocal fired
        if not optim.state and any(p.grad is not None for group in optim.param_groups for p in group["params"]):
            _state_dict.stepped_without_state(optim)  # a step with grads left it none: it keeps none
        if fired or any(_unstepped(o) for o in waiting):
            return
        fired = True
        ready()

    return [optim.register_step_post_hook(stepped) for optim in waiting]
