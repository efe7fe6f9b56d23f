"""Small deterministic models and wrappers shared by the checkpoint tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def wrap(model: nn.Module, mode: str) -> nn.Module:
    if mode == "plain":
        return model
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    raise ValueError(mode)


def train_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: int, rank: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 16, generator=g)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Unsharded model and optimizer state, keyed by FQN, as CPU tensors (rank 0 only, else None)."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {
        "model": {k: v.clone() for k, v in msd.items()},
        "optim": {
            k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in s.items()} for k, s in osd["state"].items()
        },
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for k in a["optim"]:
        for n in a["optim"][k]:
            x, y = a["optim"][k][n], b["optim"][k][n]
            assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), (k, n)
