"""Turning a user's ``state`` dict into a DCP state dict and back.

``state`` values may be ``nn.Module`` (plain, DDP, FSDP2), ``torch.optim.Optimizer``,
any DCP ``Stateful``, or plain picklable values. Models and optimizers go through
``torch.distributed.checkpoint.state_dict`` so that keys are FQNs and shards reshard.
"""

from __future__ import annotations

import logging
import pickle
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from ray_goodput.errors import ConfigError

logger = logging.getLogger(__name__)

_PLAIN_KEY = "_rg_plain"
_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)


@dataclass
class Roles:
    modules: dict[str, nn.Module]
    optimizers: dict[str, tuple[torch.optim.Optimizer, nn.Module]]
    statefuls: dict[str, Any]
    plain: dict[str, Any]


def _owner(optim: torch.optim.Optimizer, modules: dict[str, nn.Module], key: str) -> nn.Module:
    params = {id(p) for group in optim.param_groups for p in group["params"]}
    for module in modules.values():
        if any(id(p) in params for p in module.parameters()):
            return module
    raise ConfigError(
        f"state[{key!r}] is an optimizer whose parameters belong to no nn.Module in state; "
        "put the model it optimizes into the same state dict"
    )


def classify(state: dict[str, Any]) -> Roles:
    """Sort the values of ``state`` by how they are checkpointed."""
    if not isinstance(state, dict) or not state:
        raise ConfigError("state must be a non-empty dict, e.g. {'model': model, 'optim': optim}")
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    roles = Roles(modules=modules, optimizers={}, statefuls={}, plain={})
    for key, value in state.items():
        if not isinstance(key, str) or key.startswith("_rg_"):
            raise ConfigError(f"state keys must be strings not starting with '_rg_', got {key!r}")
        if key in modules:
            continue
        if isinstance(value, torch.optim.Optimizer):
            roles.optimizers[key] = (value, _owner(value, modules, key))
        elif isinstance(value, Stateful) and hasattr(value, "load_state_dict"):
            roles.statefuls[key] = value
        else:
            roles.plain[key] = value
    return roles


def to_state_dict(roles: Roles) -> dict[str, Any]:
    """The DCP state dict of the current values (tensors are live, not copies)."""
    sd: dict[str, Any] = {}
    for key, module in roles.modules.items():
        sd[key] = get_model_state_dict(module, options=_OPTIONS)
    for key, (optim, module) in roles.optimizers.items():
        sd[key] = get_optimizer_state_dict(module, optim, options=_OPTIONS)
    for key, obj in roles.statefuls.items():
        sd[key] = obj.state_dict()
    if roles.plain:
        # One opaque blob: DCP would flatten nested containers and load them into the
        # *current* value's structure, silently dropping keys added since.
        sd[_PLAIN_KEY] = pickle.dumps(roles.plain)
    return sd


@contextmanager
def saving(roles: Roles) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    """The DCP state dict to save (live tensors: copy them inside the block), and the keys
    of the optimizers that had not stepped yet.

    Building the state dict of an optimizer that has not stepped gives it state (step 1,
    zero moments; DCP steps it with zero grads at lr 0), which would change the run's next
    step: on exit those optimizers get their empty state back (and their lr and grads,
    should that step fail, as LBFGS's does without a closure). The save records them in
    its rank marker; the manifest keeps those fresh on every rank (:func:`forget_state`
    at restore)."""
    fresh = tuple(sorted(key for key, (optim, _) in roles.optimizers.items() if not optim.state))
    before = {key: _lrs_and_grads(roles.optimizers[key][0]) for key in fresh}
    try:
        yield to_state_dict(roles), fresh
    finally:
        for key in fresh:
            optim = roles.optimizers[key][0]
            optim.state.clear()
            _put_back(optim, *before[key])


def _lrs_and_grads(optim: torch.optim.Optimizer) -> tuple[list[Any], list[Any]]:
    params = [p for group in optim.param_groups for p in group["params"]]
    return [group.get("lr") for group in optim.param_groups], [p.grad for p in params]


def _put_back(optim: torch.optim.Optimizer, lrs: list[Any], grads: list[Any]) -> None:
    for group, lr in zip(optim.param_groups, lrs):
        if lr is not None:
            group["lr"] = lr
    for param, grad in zip((p for group in optim.param_groups for p in group["params"]), grads):
        param.grad = grad


def forget_state(roles: Roles, unstepped: tuple[str, ...]) -> None:
    """Empty the state of the optimizers a checkpoint saved before their first step: what
    was loaded into them is what DCP made up to have something to save."""
    for key in unstepped:
        if key in roles.optimizers:
            roles.optimizers[key][0].state.clear()


def apply_state_dict(roles: Roles, sd: dict[str, Any], state: dict[str, Any]) -> None:
    """Load ``sd`` (as filled by DCP) into the live objects; plain values into ``state``."""
    for key, module in roles.modules.items():
        set_model_state_dict(module, sd[key], options=_OPTIONS)
    for key, (optim, module) in roles.optimizers.items():
        set_optimizer_state_dict(module, optim, sd[key], options=_OPTIONS)
    for key, obj in roles.statefuls.items():
        obj.load_state_dict(sd[key])
    if roles.plain:
        state.update(pickle.loads(sd[_PLAIN_KEY]))  # noqa: S301 - our own checkpoint


def rng_state_bytes() -> bytes:
    """Python, NumPy, torch CPU (and CUDA, when present) RNG states of this process."""
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return pickle.dumps(states)


def restore_rng(data: bytes) -> None:
    """Set this process's RNG states from :func:`rng_state_bytes` output."""
    states = pickle.loads(data)  # noqa: S301 - our own file, verified against the manifest
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        restore_cuda_rng(states["cuda"])


def restore_cuda_rng(per_device: list[torch.Tensor]) -> int:
    """Set the CUDA RNG state of each local device that was saved; returns how many.

    One by one, so a worker that now sees fewer (or more) devices than the one that saved
    restores those it has instead of failing on the count."""
    count = min(len(per_device), torch.cuda.device_count())
    for index in range(count):
        torch.cuda.set_rng_state(per_device[index], index)
    if count != len(per_device):
        logger.info("restored the CUDA RNG state of %d of %d saved devices", count, len(per_device))
    return count
