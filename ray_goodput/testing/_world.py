"""Run a function on N real processes joined by a gloo process group."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from ray_goodput.testing._net import free_port

# Ranks fork from a server that imported these once (about 3 s per process on 2 cores
# when each rank imports them itself, as spawn does). Only third-party modules that read
# no environment at import: the library, Ray and the function's own module are imported
# by each rank, after it took on the caller's environment. ``torch._dynamo`` is what the
# first optimizer imports (~1 s); it reads only its own ``TORCH*`` settings at import.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
            "pyarrow", "pyarrow.fs"]


def _entry(rank: int, payload: bytes, world_size: int, port: int, results: Any,
           environ: dict[str, str]) -> None:
    # A forked rank inherits the server's environment from when it started: use the
    # caller's as of this call, as a spawned process would. The function and its arguments
    # arrive pickled and are unpickled only now: unpickling imports their modules, and a
    # module may read the environment at import (``import ray`` reads RAY_AUTH_MODE).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    fn, args = pickle.loads(payload)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - shipped back to the parent
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = 300.0, allow_deaths: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes over gloo.

    ``fn`` must be importable (module level). Returns each rank's return value; raises
    with the child's traceback when one fails. With ``allow_deaths`` a rank that was
    killed (e.g. by a fault injector) yields None instead of an error.
    """
    port = free_port()
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server first starts
    with mp.Manager() as manager:
        results = manager.dict()
        payload = pickle.dumps((fn, args))
        ctx = mp.start_processes(_entry, args=(payload, world_size, port, results, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method="forkserver")
        for proc in ctx.processes:
            proc.join(timeout_s)
        alive = [p for p in ctx.processes if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"{len(alive)} rank(s) still running after {timeout_s}s")
        out = []
        for rank, proc in enumerate(ctx.processes):
            status, value = results.get(rank, ("died", f"exit code {proc.exitcode}"))
            if status == "error" or (status == "died" and not allow_deaths):
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out.append(value if status == "ok" else None)
        return out
