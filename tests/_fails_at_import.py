"""Functions for the ``run_world`` tests. Importing this module fails in the rank named by
``RAY_GOODPUT_TEST_FAIL_IMPORT_RANK``
(``run_world`` ranks import a function's module when they unpickle it, before they join
the process group): a rank that dies before the rendezvous."""

from __future__ import annotations

import os

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("RAY_GOODPUT_TEST_FAIL_IMPORT_RANK"):
    raise ImportError(f"rank {os.environ['RANK']} cannot import {__name__} (on purpose)")


def barrier(rank: int, world: int) -> int:
    import torch.distributed as dist

    dist.barrier()
    return rank


def rank_1_raises(rank: int, world: int) -> int:
    import time

    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(60)  # busy elsewhere (not in a collective, where gloo would see the peer go)
    return rank


def sleeps(rank: int, world: int, seconds: float) -> None:
    import time

    time.sleep(seconds)
