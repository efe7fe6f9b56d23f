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


def count(endpoint: str, world_size: int, saves: int = 3, eager_open: bool = False) -> Counter:
    """Requests per checkpoint by method (floats) for one world size; ``marker GETs``
    (reads of rank markers, already among the GETs) on the side. ``eager_open``: S3
    streams open at once (pyarrow's default: a multipart upload per write)."""
    import pyarrow.fs as pafs

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
    proxy = FlakyProxy(endpoint, 0.0)
    uri = f"s3://{bucket}/run?endpoint_override={proxy.endpoint}&scheme=http"
    if eager_open:
        uri += "&allow_delayed_open=false"
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
    parser.add_argument("--open", choices=["lazy", "eager", "both"], default="lazy",
                        help="S3 streams: lazy (the library's default), eager (pyarrow's), both")
    args = parser.parse_args(argv)
    from ray_goodput.testing._s3 import start_moto_server

    modes = ["eager", "lazy"] if args.open == "both" else [args.open]
    proc, endpoint = start_moto_server()
    try:
        tables = {mode: [(world, count(endpoint, world, args.saves, eager_open=mode == "eager"))
                         for world in args.worlds] for mode in modes}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    for mode, rows in tables.items():
        print(f"\nS3 streams opened {'at once (pyarrow default)' if mode == 'eager' else 'lazily'}:\n")
        _print_table(rows)
    if len(tables) == 2:
        print("\n| world | total, eager | total, lazy | lazy / eager |\n|---|---|---|---|")
        for (world, eager), (_, lazy) in zip(tables["eager"], tables["lazy"]):
            e, z = _total(eager), _total(lazy)
            print(f"| {world} | {e:.1f} | {z:.1f} | {z / e:.2f}x |")
    return 0


def _total(counts: Counter) -> float:
    return sum(v for m, v in counts.items() if m != "marker GETs")


def _print_table(rows: list[tuple[int, Counter]]) -> None:
    methods = sorted({m for _, c in rows for m in c} - {"marker GETs"}) + ["marker GETs"]
    print("| world | " + " | ".join(methods) + " | total / checkpoint | per rank | vs world "
          f"{rows[0][0]} |")
    print("|---|" + "---|" * (len(methods) + 3))
    base = _total(rows[0][1])
    for world, counts in rows:
        total = _total(counts)
        cells = " | ".join(f"{counts.get(m, 0):.1f}" for m in methods)
        print(f"| {world} | {cells} | {total:.1f} | {total / world:.1f} | {total / base:.2f}x |")


if __name__ == "__main__":
    raise SystemExit(main())
