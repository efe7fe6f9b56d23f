"""Small helpers shared by the checkpoint tests of several modules: the files this process
has mapped, a saved model + optimizer with its node-local copy, a dead process's pid and
a stepped optimizer."""

from __future__ import annotations

from pathlib import Path

import torch

from ray_goodput import Checkpointer


def mapped_paths() -> set[str]:
    """Files this process has mapped now (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


def saved_at(root: str, staging: Path, size: int = 256) -> tuple[torch.nn.Module, torch.optim.Optimizer, Path]:
    """Step 1 of a model + stepped AdamW, saved with its node-local copy in ``staging``;
    returns them and that copy's directory of the run."""
    model = torch.nn.Linear(size, size)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, size)).sum().backward()
    optim.step()
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        return model, optim, ckpt.staging


def dead_pid() -> int:
    """The pid of a process that has exited (no process has it now, as far as a test can tell)."""
    import subprocess

    proc = subprocess.Popen(["sleep", "0"])
    proc.wait()
    return proc.pid


def stepped(model: torch.nn.Module) -> dict:
    """``model`` and an AdamW that took one step (zero gradients): a resumed attempt's state."""
    optim = torch.optim.AdamW(model.parameters())
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optim.step()
    return {"model": model, "optim": optim}


def unshare_or_skip(what: str) -> str:
    """The ``unshare`` command, able to mount a small tmpfs in a user namespace of its own;
    else the test skips, saying ``what`` needs it (util-linux missing, or user namespaces off)."""
    import shutil
    import subprocess

    import pytest

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip(f"{what} needs unshare (util-linux) to mount a small tmpfs in a user namespace")
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{what} needs user namespaces to mount a small tmpfs (unshare: {probe.stderr.decode()[:200]})")
    return unshare
