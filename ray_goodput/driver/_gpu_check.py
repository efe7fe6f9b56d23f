"""The default node health check, ``Recovery(health_check="gpu")``: every visible GPU
multiplies correctly and can allocate memory.

Apart from ``_health`` so that a check task imports torch only when it checks GPUs: a
user's own check runs in a fresh process on every node before every attempt, and should
not pay for torch there (seconds of restart downtime) when it does not use it.
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

MATMUL_SIZE = 256
RELATIVE_TOLERANCE = 1e-3


def compare_results(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when ``actual`` is finite and matches ``expected``; else what is wrong."""
    if not torch.isfinite(actual).all():
        return "the result holds NaN or Inf"
    scale = expected.abs().max().item() or 1.0
    error = (actual.double() - expected.double()).abs().max().item() / scale
    if not math.isfinite(error) or error > RELATIVE_TOLERANCE:
        return f"the result differs from the CPU's by {error:.3g} (relative), over {RELATIVE_TOLERANCE:g}"
    return None


def check_device(device: torch.device, *, alloc_gib: float) -> str | None:
    """Matmul on ``device`` checked against the CPU, then allocate and touch ``alloc_gib``.
    None when healthy, else the reason."""
    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=gen)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=gen)
    problem = compare_results((a.to(device) @ b.to(device)).cpu(), a @ b)
    if problem:
        return f"{device}: {problem}"
    nbytes = int(alloc_gib * 2**30)
    if nbytes:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        block.fill_(0xA5)
        if int(block[-1].item()) != 0xA5:
            return f"{device}: a {alloc_gib:g} GiB block does not read back what was written"
        del block
    return None


def gpu_check(alloc_gib: float = 2.0) -> bool:
    """The default check (``Recovery(health_check="gpu")``): every visible GPU multiplies
    correctly and can allocate ``alloc_gib``. Raises RuntimeError naming the GPU and the
    fault. A node without GPUs passes, with a log note (nothing to check there)."""
    if not torch.cuda.is_available():
        logger.info("no GPU visible on this node; the GPU health check passes without checking")
        return True
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would fail the comparison on a good GPU
    try:
        for index in range(torch.cuda.device_count()):
            problem = check_device(torch.device("cuda", index), alloc_gib=alloc_gib)
            if problem:
                raise RuntimeError(f"GPU health check failed: {problem}")
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32  # the task's process is reused by others
    return True
