"""Node health checks run by ``Recovery`` before each attempt, and the default GPU check.

A check is a plain function run as a Ray task pinned to the node (hard node affinity,
``num_cpus=0`` so it never waits behind the training workers' resources). It passes when it
returns anything but ``False``; raising, returning ``False`` or outliving the timeout marks
the node unhealthy. A task with no GPU request still sees every GPU of its node (Ray 2.60
leaves ``CUDA_VISIBLE_DEVICES`` alone when a task asks for none), which is what a check of
the whole node needs.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)

HealthCheck = Callable[[], object]

MATMUL_SIZE = 256
RELATIVE_TOLERANCE = 1e-3


def _run_check(check: HealthCheck) -> str | None:
    """Run ``check`` here; None when healthy, else the reason."""
    try:
        verdict = check()
    except Exception as exc:  # any failure of a check is a verdict, not a crash
        return f"{type(exc).__name__}: {exc}"
    return "the check returned False" if verdict is False else None


_remote_check = ray.remote(num_cpus=0, max_retries=0)(_run_check)


def check_nodes(check: HealthCheck, node_ids: list[str], timeout_s: float) -> dict[str, str]:
    """Run ``check`` on every node at once; ``{node_id: reason}`` of the unhealthy ones.

    Blocks at most ``timeout_s``; a node whose check has not answered by then is unhealthy
    (a hung GPU looks exactly like that) and its task is cancelled.
    """
    refs = {
        _remote_check.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            name=f"ray_goodput_health_check:{node[:12]}",
        ).remote(check): node
        for node in node_ids
    }
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    unhealthy = {}
    for ref in done:
        try:
            reason = ray.get(ref)
        except Exception as exc:  # the task's process died: the node cannot run work
            reason = f"the check's process failed: {type(exc).__name__}: {exc}"
        if reason is not None:
            unhealthy[refs[ref]] = reason
    for ref in pending:
        ray.cancel(ref, force=True)
        unhealthy[refs[ref]] = f"the check did not answer within {timeout_s:g} s"
    return unhealthy


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
