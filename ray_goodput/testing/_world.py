"""Run a function on N real processes joined by a gloo process group."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"

# Ranks fork from a server that imported these once (seconds per process when each
# rank imports them itself, as spawn does). Only third-party modules that read
# no environment at import: the library, Ray and the function's own module are imported
# by each rank, after it took on the caller's environment. ``torch._dynamo`` is what the
# first optimizer imports (slow); it reads only its own ``TORCH*`` settings at import.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "pyarrow", "pyarrow.fs"]


#: The store's and the process group's timeout is at least this: a short ``timeout_s`` bounds
#: the run (the watcher), not the rendezvous, which a loaded machine can take seconds for
#: (a rank then failed to join instead of being reported still running).
_MIN_GROUP_TIMEOUT_S = 60.0


def _entry(
    rank: int, payload: bytes, world_size: int, port: int, results: Any, environ: dict[str, str], timeout_s: float
) -> None:
    # A forked rank inherits the server's environment from when it started: use the
    # caller's as of this call, as a spawned process would. The function and its arguments
    # arrive pickled and are unpickled only now: unpickling imports their modules, and a
    # module may read the environment at import (``import ray`` reads RAY_AUTH_MODE).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR=_HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    timeout = timedelta(seconds=max(timeout_s, _MIN_GROUP_TIMEOUT_S))
    try:
        fn, args = pickle.loads(payload)  # noqa: S301 - the parent test process pickled it
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:  # noqa: BLE001 - shipped back to the parent
        results[rank] = ("startup", traceback.format_exc())
        return  # (a raise would leave torch's error file behind; the parent has the traceback)
    results[rank] = ("running", None)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - shipped back to the parent
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def _state(rank: int, proc: Any, results: Any) -> str:
    status, _ = results.get(rank, ("starting", None))
    return f"rank {rank}: {status}" + ("" if proc.is_alive() else f", exit code {proc.exitcode}")


def run_world(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0, allow_deaths: bool = False
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes over gloo.

    ``fn`` must be importable (module level). Returns each rank's return value; raises
    with the child's traceback as soon as one fails (its peers would wait for it in their
    next collective). With ``allow_deaths`` a rank that was killed after it joined the
    process group (e.g. by a fault injector) yields None instead of an error; one that
    exits before it joined still raises. Raises ``TimeoutError`` naming each rank's state
    when ranks are still running after ``timeout_s``. The rendezvous and the process
    group's collectives time out after ``timeout_s`` too, but never under 60 s.
    """
    # The rendezvous store lives here, on a port the OS bound for it: no port is picked
    # first and bound later by rank 0 (another process can take it in between, and then
    # rank 0 fails while its peers retry connecting for the whole store timeout).
    store = dist.TCPStore(
        _HOST,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=max(timeout_s, _MIN_GROUP_TIMEOUT_S)),
    )
    try:
        return _run(fn, world_size, args, store.port, timeout_s, allow_deaths)
    finally:
        # Gone now, also when this raised (a traceback would keep it alive): a process
        # forked from this one later (a DataLoader worker) must not inherit a store whose
        # server thread it lacks; destroying it there aborts the process.
        del store


def _run(
    fn: Callable[..., Any], world_size: int, args: tuple, port: int, timeout_s: float, allow_deaths: bool
) -> list[Any]:
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server first starts
    # The results dict's server forks from the fork server too, not from this process
    # (which may hold objects that cannot survive a fork, as a store above).
    with mp.get_context("forkserver").Manager() as manager:
        results = manager.dict()
        payload = pickle.dumps((fn, args))
        ctx = mp.start_processes(
            _entry,
            args=(payload, world_size, port, results, dict(os.environ), timeout_s),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        procs = ctx.processes
        try:
            _watch(procs, results, timeout_s, allow_deaths)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        _raise_failures(procs, results, allow_deaths)
        done = [results.get(rank, ("killed", None)) for rank in range(world_size)]
        return [value if status == "ok" else None for status, value in done]


def _watch(procs: list[Any], results: Any, timeout_s: float, allow_deaths: bool) -> None:
    """Until every rank has exited. Raises at once when a rank dies before it joined the
    process group (its peers would wait for it), when one raised, or, without
    ``allow_deaths``, when one died; raises after ``timeout_s`` naming each rank's state."""
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs):
        _raise_failures(procs, results, allow_deaths)
        if time.monotonic() > deadline:
            states = "; ".join(_state(r, p, results) for r, p in enumerate(procs))
            raise TimeoutError(f"ranks still running after {timeout_s}s ({states})")
        time.sleep(0.05)


def _raise_failures(procs: list[Any], results: Any, allow_deaths: bool) -> None:
    """RuntimeError with every exited rank that ends the run, and why."""
    failed = [_failure(rank, proc, results, allow_deaths) for rank, proc in enumerate(procs) if not proc.is_alive()]
    failed = [f for f in failed if f]
    if failed:
        raise RuntimeError("\n".join(failed))


def _failure(rank: int, proc: Any, results: Any, allow_deaths: bool) -> str | None:
    """Why an exited rank ends the run now, or None when it does not."""
    status, value = results.get(rank, ("starting", None))
    detail = value or f"exit code {proc.exitcode}"
    if status in ("starting", "startup"):
        return f"rank {rank} exited before it joined the process group:\n{detail}"
    if status == "error" or (not allow_deaths and status != "ok"):
        return f"rank {rank} failed:\n{detail}"
    return None
