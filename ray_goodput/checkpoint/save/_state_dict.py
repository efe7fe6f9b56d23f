"""Turning a user's ``state`` dict into a DCP state dict and back.

``state`` values may be ``nn.Module`` (plain, DDP, FSDP2), ``torch.optim.Optimizer``,
any DCP ``Stateful``, or plain picklable values. Models and optimizers go through
``torch.distributed.checkpoint.state_dict`` so that keys are FQNs and shards reshard.

A plain value (``model.state_dict()``, a dict of EMA weights, a mixed tree) is split: every
tensor in it, however deep in dicts, lists and tuples (DTensors included), is a DCP tensor
of its own under ``_rg_tensors`` (copied into the snapshot arena, resharded, loaded in
place), and the rest, the tree with a :class:`TensorLeaf` where each tensor was, is pickled
under ``_rg_plain``. A restore rebuilds each plain value as it was saved (see
:func:`fit_plain_tensors` for a state whose tensors differ from the checkpoint's).
"""

from __future__ import annotations

import copy
import logging
import pickle
import random
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
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

_INTERNAL_PREFIX = "_rg_"  # state keys of the library's own (a user's may not start so)
_PLAIN_KEY = "_rg_plain"
_TENSORS_KEY = "_rg_tensors"
_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)
#: Optimizers whose made-up step left no state (SGD without momentum): they keep none, so a
#: save needs no made-up step for them (see :func:`made_up_state`).
_STATELESS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


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
        if not isinstance(key, str) or key.startswith(_INTERNAL_PREFIX):
            raise ConfigError(f"state keys must be strings not starting with {_INTERNAL_PREFIX!r}, got {key!r}")
        if key in modules:
            continue
        if isinstance(value, torch.optim.Optimizer):
            roles.optimizers[key] = (value, _owner(value, modules, key))
        elif isinstance(value, Stateful) and hasattr(value, "load_state_dict"):
            roles.statefuls[key] = value
        else:
            roles.plain[key] = value
    return roles


@dataclass(frozen=True)
class TensorLeaf:
    """Where a tensor sat in a plain value: its path (the key under ``_rg_tensors``)."""

    path: str


def _split(value: Any, path: str, tensors: dict[str, Any]) -> Any:
    """``value`` with each tensor replaced by a TensorLeaf (the tensors go into ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return TensorLeaf(path)
    if isinstance(value, Mapping):
        if not any(_holds_tensor(v) for v in value.values()):
            return value
        out = copy.copy(value)  # keeps the mapping's type (OrderedDict, defaultdict, ...)
        for k, v in value.items():
            out[k] = _split(v, f"{path}/{k!r}", tensors)
        return out
    if isinstance(value, (list, tuple)) and any(_holds_tensor(v) for v in value):
        items = [_split(v, f"{path}/[{i}]", tensors) for i, v in enumerate(value)]
        if isinstance(value, list):
            out = copy.copy(value)
            out[:] = items
            return out
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple
    return value


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _join(value: Any, tensors: dict[str, Any]) -> Any:
    """The inverse of :func:`_split`: each TensorLeaf replaced by its tensor."""
    if isinstance(value, TensorLeaf):
        return tensors[value.path]
    if isinstance(value, Mapping):
        if not any(_holds_leaf(v) for v in value.values()):
            return value
        for k, v in list(value.items()):
            value[k] = _join(v, tensors)  # the unpickled copy is ours to fill
        return value
    if isinstance(value, (list, tuple)) and any(_holds_leaf(v) for v in value):
        items = [_join(v, tensors) for v in value]
        if isinstance(value, list):
            value[:] = items
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _holds_leaf(value: Any) -> bool:
    if isinstance(value, TensorLeaf):
        return True
    if isinstance(value, Mapping):
        return any(_holds_leaf(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_leaf(v) for v in value)
    return False


def fit_plain_tensors(template: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Make the restore ``template``'s plain tensors those of the checkpoint (``saved``: DCP's
    ``state_dict_metadata``). The rule: a plain value comes back as it was saved. A tensor
    at a path both have is loaded in place into the state's tensor (another shape is a
    StateMismatchError, raised by the caller's check). One the checkpoint has and the state
    lacks is created from the checkpoint's size and dtype (logged at INFO). One the state
    has and the checkpoint lacks is left out of the restored value (logged as a WARNING)."""
    current: dict[str, Any] = template.get(_TENSORS_KEY, {})
    prefix = _TENSORS_KEY + "."
    stored = {fqn[len(prefix) :]: meta for fqn, meta in saved.items() if fqn.startswith(prefix)}
    dropped = sorted(set(current) - set(stored))
    added = sorted(set(stored) - set(current))
    fitted = {path: tensor for path, tensor in current.items() if path in stored}
    for path in added:
        meta = stored[path]
        fitted[path] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    if dropped:
        logger.warning(
            "restore: %d tensor(s) of the state's plain values are not in the checkpoint and are "
            "left out of the restored values: %s",
            len(dropped),
            ", ".join(dropped[:8]),
        )
    if added:
        logger.info(
            "restore: %d tensor(s) of the checkpoint's plain values are new here: %s", len(added), ", ".join(added[:8])
        )
    if fitted:
        template[_TENSORS_KEY] = fitted
    else:
        template.pop(_TENSORS_KEY, None)


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
        # The tree without its tensors is one pickled blob: DCP would flatten nested
        # containers and load them into the *current* value's structure, silently
        # dropping keys added since. Its tensors are DCP tensors of their own.
        tensors: dict[str, Any] = {}
        skeleton = {key: _split(value, repr(key), tensors) for key, value in roles.plain.items()}
        sd[_PLAIN_KEY] = pickle.dumps(skeleton)
        if tensors:
            sd[_TENSORS_KEY] = tensors
    return sd


@dataclass(frozen=True)
class Captured:
    """A rank's state as one save writes it: DCP's flat state dict and what rides along."""

    flat: dict[str, Any]  # FQN -> leaf; tensors are the live ones (the caller copies them)
    mappings: Any  # DCP's flattening map (to rebuild the nesting on restore)
    rng: bytes  # this process's RNG states (:func:`rng_state_bytes`)
    unstepped: tuple[str, ...]  # optimizers saved before their first step (state made up)
    stepped: tuple[str, ...]  # ... and those saved after it


def capture(state: dict[str, Any]) -> Captured:
    """The flat DCP state dict of ``state`` (:func:`classify`, then :func:`saving`); the
    optimizers that never stepped are as they were when it returns, their made-up state
    kept alive only by the result. ConfigError names the fix for a bad ``state``."""
    roles = classify(state)
    with saving(roles) as (sd, unstepped):
        flat, mappings = flatten_state_dict(sd)
    stepped = tuple(sorted(set(roles.optimizers) - set(unstepped)))
    return Captured(flat=flat, mappings=mappings, rng=rng_state_bytes(), unstepped=unstepped, stepped=stepped)


@contextmanager
def saving(roles: Roles) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    """The DCP state dict to save (live tensors: copy them before the model steps again),
    and the keys of the optimizers that had not stepped yet, whose saved state DCP made up;
    on exit those optimizers are as they were (see :func:`made_up_state`): their made-up
    state is dropped from them, not changed, so the dict still holds it."""
    with made_up_state(roles, keep=False) as fresh:
        yield to_state_dict(roles), fresh


@contextmanager
def made_up_state(roles: Roles, *, keep: bool) -> Iterator[tuple[str, ...]]:
    """For the block, the keys of the optimizers with no state yet, whose grads are set
    aside so that DCP's state-dict builder gives each state of the same structure (it
    steps them at lr 0 with zero grads: step 1, zero moments; with any grad set it gives
    none). On exit their grads come back; their state and lr too, unless the block
    succeeded and ``keep`` (a restore keeps what it loaded). A failed step (LBFGS needs a
    closure) leaves lr 0 and zero grads behind: they are put back as well.

    An optimizer whose made-up step left no state keeps none (SGD without momentum): later
    blocks give it no made-up step, which would otherwise come at every save (zero grads
    for every parameter, a step, the user's step hooks). DCP runs that step whenever no
    parameter has a grad, so for the block its smallest parameter gets a zero grad, and it
    is still among the keys yielded (its saved state is as empty as a made-up one)."""
    fresh = tuple(sorted(key for key, (optim, _) in roles.optimizers.items() if not optim.state))
    before = {key: _lrs_and_grads(roles.optimizers[key][0]) for key in fresh}
    # DCP's made-up step gives a zero grad to every parameter that requires one: a step of
    # an optimizer with such a parameter that leaves it no state shows it keeps none.
    trainable = {key: any(p.requires_grad for p in _params(roles.optimizers[key][0])) for key in fresh}
    placeholders = []
    done = False
    try:
        for key in fresh:
            optim = roles.optimizers[key][0]
            params = _params(optim)
            if not keeps_no_state(optim):
                for param in params:
                    param.grad = None
            elif all(param.grad is None for param in params) and trainable[key]:
                smallest = min((p for p in params if p.requires_grad), key=torch.numel)
                smallest.grad = torch.zeros_like(smallest)
                placeholders.append(smallest)
        yield fresh
        done = True
    finally:
        for param in placeholders:
            param.grad = None
        for key in fresh:
            optim = roles.optimizers[key][0]
            lrs, grads = before[key]
            if done and not optim.state and trainable[key]:
                stepped_without_state(optim)
            if not (done and keep):
                optim.state.clear()
                for group, lr in zip(optim.param_groups, lrs):
                    if lr is not None:
                        group["lr"] = lr
            for param, grad in zip(_params(optim), grads):
                param.grad = grad


def keeps_no_state(optim: torch.optim.Optimizer) -> bool:
    """Whether a step of ``optim`` was seen to leave it no state (SGD without momentum)."""
    return optim in _STATELESS


def stepped_without_state(optim: torch.optim.Optimizer) -> None:
    """Note that a step of ``optim`` in which some parameter had a grad left it no state:
    it keeps none. (A step with every grad None leaves any optimizer without state.)"""
    _STATELESS.add(optim)


def _params(optim: torch.optim.Optimizer) -> list[Any]:
    return [p for group in optim.param_groups for p in group["params"]]


def _lrs_and_grads(optim: torch.optim.Optimizer) -> tuple[list[Any], list[Any]]:
    return [group.get("lr") for group in optim.param_groups], [p.grad for p in _params(optim)]


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
        plain = pickle.loads(sd[_PLAIN_KEY])  # noqa: S301 - our own checkpoint
        tensors = sd.get(_TENSORS_KEY, {})
        state.update({key: _join(value, tensors) for key, value in plain.items()})


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
