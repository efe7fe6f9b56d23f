"""Staging: a host-memory snapshot of a state dict into buffers reused across saves.

This is the only part of a save that training waits for. It must be a copy (training
goes on mutating parameters), and it must not allocate on every save: buffers are kept
by path and reused while shapes and dtypes stay the same. On GPU the buffers are pinned
and the device-to-host copies are issued non-blocking, then synchronized once.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class HostBuffers:
    """Reusable host buffers for one rank's snapshots. Not thread-safe: one save at a time."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def _buffer_for(self, path: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
            self.bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        return buf

    def _copy_tensor(self, path: str, src: torch.Tensor) -> torch.Tensor:
        src = src.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        buf = self._buffer_for(path, src)
        buf.copy_(src, non_blocking=src.device.type == "cuda")
        return buf

    def _copy(self, path: str, value: Any) -> Any:
        if isinstance(value, DTensor):
            local = self._copy_tensor(path, value.to_local())
            return DTensor.from_local(local, value.device_mesh, value.placements,
                                      run_check=False, shape=value.size(), stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(path, value)
        if isinstance(value, dict):
            return {k: self._copy(f"{path}/{k}", v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(f"{path}/{i}", v) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def snapshot(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in host memory; blocks until the copy is complete."""
        out = {k: self._copy(k, v) for k, v in state_dict.items()}
        if torch.cuda.is_available() and any(b.is_pinned() for b in self._buffers.values()):
            torch.cuda.synchronize()
        return out
