"""Storage requests per checkpoint at world sizes 2, 4, 8 (real processes, real S3 server).

Each world runs in real processes over gloo (``run_world``) with the thread uploader,
saving to moto's S3 server through a :class:`FlakyProxy` that fails nothing and counts
every request. The ranks make one warm-up save (storage probe, generation claim, first
plan), then the parent snapshots the counts and lets them make ``--saves`` more saves,
each waited for. Requests per checkpoint = (final - snapshot) / saves.

    python benchmarks/storage_requests.py [--worlds 2 4 8] [--saves 3]

Prints a markdown table: requests per checkpoint by method, and per rank.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import uuid
from collections import Counter
from typing import Any

import torch
import torch.multiprocessing as mp

from ray_goodput.testing import FlakyProxy, run_world

_WAIT_S = 300.0

# moto accepts any credentials; spawned ranks inherit these.
for _key, _value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                     ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):
    os.environ.setdefault(_key, _value)


def _rank(rank: int, world_size: int, uri: str, staging: str, saves: int, warm: Any, go: Any) -> int:
    import torch.distributed as dist

    from ray_goodput import Checkpointer

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with Checkpointer(uri, staging_dir=f"{staging}/{rank}", uploader="thread", keep_last=100) as ckpt:
        ckpt.save(0, {"model": model})
        ckpt.wait()
        dist.barrier()
        if rank == 0:
            warm.set()
            if not go.wait(_WAIT_S):
                raise TimeoutError("the parent did not snapshot the request counts")
        dist.barrier()
        for step in range(1, saves + 1):
            ckpt.save(step, {"model": model})
            ckpt.wait()
        dist.barrier()
    return len(ckpt.stats.committed)


def count(endpoint: str, world_size: int, saves: int = 3) -> Counter:
    """Requests per checkpoint by method (floats) for one world size; ``marker GETs``
    (reads of rank markers, already among the GETs) on the side."""
    import pyarrow.fs as pafs

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
    proxy = FlakyProxy(endpoint, 0.0)
    uri = f"s3://{bucket}/run?endpoint_override={proxy.endpoint}&scheme=http"
    snap: dict[str, Counter] = {}
    try:
        with mp.Manager() as manager, tempfile.TemporaryDirectory() as staging:
            warm, go = manager.Event(), manager.Event()

            def _snapshot() -> None:
                if warm.wait(_WAIT_S):
                    snap["before"] = Counter(proxy.requests)
                    go.set()

            watcher = threading.Thread(target=_snapshot, daemon=True)
            watcher.start()
            committed = run_world(_rank, world_size, uri, staging, saves, warm, go, timeout_s=_WAIT_S)
            watcher.join(5)
        if committed != [saves + 1] * world_size or "before" not in snap:
            raise RuntimeError(f"world {world_size}: expected {saves + 1} commits per rank, got {committed}")
        delta = Counter(proxy.requests)
        delta.subtract(snap["before"])
    finally:
        proxy.close()
    by_method: Counter = Counter()
    for (method, path), n in delta.items():
        by_method[method] += n / saves
        if method == "GET" and "/.ranks/" in path:
            by_method["marker GETs"] += n / saves
    return by_method


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args(argv)
    from ray_goodput.testing._s3 import start_moto_server

    proc, endpoint = start_moto_server()
    try:
        rows = []
        for world in args.worlds:
            t0 = time.perf_counter()
            counts = count(endpoint, world, args.saves)
            rows.append((world, counts, time.perf_counter() - t0))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    methods = sorted({m for _, c, _ in rows for m in c} - {"marker GETs"}) + ["marker GETs"]
    print("| world | " + " | ".join(methods) + " | total / checkpoint | per rank | vs world "
          f"{rows[0][0]} |")
    print("|---|" + "---|" * (len(methods) + 3))
    base = sum(v for m, v in rows[0][1].items() if m != "marker GETs")
    for world, counts, _ in rows:
        total = sum(v for m, v in counts.items() if m != "marker GETs")
        cells = " | ".join(f"{counts.get(m, 0):.1f}" for m in methods)
        print(f"| {world} | {cells} | {total:.1f} | {total / world:.1f} | {total / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
