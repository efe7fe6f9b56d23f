"""Storage requests per checkpoint at world sizes 2, 4, 8 (real processes, real S3 server).

Each world runs in real processes over gloo (``run_world``) with the thread uploader,
saving to moto's S3 server through a :class:`FlakyProxy` that fails nothing and counts
every request. The ranks make one warm-up save (storage probe, generation claim, first
plan), then the parent snapshots the counts and lets them make ``--saves`` more saves,
each waited for. Requests per checkpoint = (final - snapshot) / saves.

    python benchmarks/storage_requests.py [--worlds 2 4 8] [--saves 3] [--restore-only]
    python benchmarks/storage_requests.py --worlds 2 --saves 1 --layers 2 --out /tmp/requests.json  # smoke

Prints a markdown table: requests per checkpoint by method, and per rank; and the verdict
on ``benchmarks/targets.toml``'s ``storage_requests`` target (requests grow at most
linearly with the world size). Writes the results to
``benchmarks/results/storage_requests_cpu.json`` (``--out``).

Then bytes read per rank at restore, same world sizes: an FSDP2-sharded MLP with AdamW
(``--layers`` x 512 x 512, fp32) saved once to the S3 server and restored cold (empty
staging directory) by every rank, side by side with block checksums in use and without
(as for a manifest written before them: each rank then read every other rank's file
whole for its few replicated records). Blocks are ``--block-kib`` (the library's 8 MiB
scaled down with the model, so that shards span many blocks as multi-GB ones do).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import uuid
from collections import Counter
from typing import Any

import _results
import _targets
import torch
import torch.multiprocessing as mp

from ray_goodput.testing import FlakyProxy, run_world

_WAIT_S = 300.0

# moto accepts any credentials; spawned ranks inherit these.
for _key, _value in (
    ("AWS_ACCESS_KEY_ID", "testing"),
    ("AWS_SECRET_ACCESS_KEY", "testing"),
    ("AWS_DEFAULT_REGION", "us-east-1"),
    ("AWS_EC2_METADATA_DISABLED", "true"),
):
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


def _fsdp(world_size: int, layers: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    return {"model": model, "optim": optim}


def _restore_rank(rank: int, world_size: int, uri: str, staging: str, layers: int, block_kib: int) -> dict:
    import torch.distributed as dist

    from ray_goodput import Checkpointer
    from ray_goodput.checkpoint.protocol import _layout
    from ray_goodput.checkpoint.restore import _storage_fetch, _tiered_fs
    from ray_goodput.storage import _checksum, list_dir, resolve

    _checksum.BLOCK_BYTES = block_kib << 10
    with Checkpointer(uri, staging_dir=f"{staging}/save-{rank}", uploader="thread") as ckpt:
        ckpt.save(1, _fsdp(world_size, layers, 0))
        ckpt.wait()
    dist.barrier()
    files = list_dir(resolve(uri).child("checkpoints", _layout.step_dir(1)))
    own = sum(i.size for i in files if i.base_name.startswith(f"__{rank}_"))
    total = sum(i.size for i in files if i.base_name.endswith(".distcp"))
    out = {"own": own, "total": total}
    block_runs = _storage_fetch._block_runs
    for mode in ("blocks", "whole"):
        if mode == "whole":  # as for a manifest without block checksums
            _storage_fetch._block_runs = _tiered_fs._block_runs = lambda want, ranges: None
        with Checkpointer(uri, staging_dir=f"{staging}/cold-{mode}-{rank}", uploader="thread") as ckpt:
            assert ckpt.restore(_fsdp(world_size, layers, 1)) == 1
            out[mode] = ckpt.last_restore.remote_bytes
            out[f"{mode}_s"] = ckpt.last_restore.seconds
        _storage_fetch._block_runs = _tiered_fs._block_runs = block_runs
        dist.barrier()
    return out


def restore_bytes(endpoint: str, world_size: int, layers: int, block_kib: int) -> list[dict]:
    """Per rank: own shard bytes, checkpoint bytes, bytes read at restore with and
    without block checksums."""
    import pyarrow.fs as pafs

    bucket = f"r-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
    uri = f"s3://{bucket}/run?endpoint_override={endpoint}&scheme=http"
    with tempfile.TemporaryDirectory() as staging:
        return run_world(_restore_rank, world_size, uri, staging, layers, block_kib, timeout_s=_WAIT_S)


def _restore_table(rows: list[tuple[int, list[dict]]]) -> list[str]:
    mib = 1 << 20
    out = [
        "| world | checkpoint (MiB) | own shard / rank (MiB) | read / rank, whole files (MiB) | "
        "read / rank, blocks (MiB) | blocks / own shard | whole / blocks | all ranks read, "
        "blocks / checkpoint |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, ranks in rows:
        own = sum(r["own"] for r in ranks) / world
        whole = sum(r["whole"] for r in ranks) / world
        blocks = sum(r["blocks"] for r in ranks) / world
        total = ranks[0]["total"]
        out.append(
            f"| {world} | {total / mib:.1f} | {own / mib:.2f} | {whole / mib:.2f} | {blocks / mib:.2f} | "
            f"{blocks / own:.2f}x | {whole / blocks:.2f}x | {blocks * world / total:.2f}x |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument(
        "--open",
        choices=["lazy", "eager", "both"],
        default="lazy",
        help="S3 streams: lazy (the library's default), eager (pyarrow's), both",
    )
    parser.add_argument("--layers", type=int, default=8, help="restore: 512x512 layers of the MLP")
    parser.add_argument("--block-kib", type=int, default=64, help="restore: block checksum size")
    parser.add_argument("--restore-only", action="store_true", help="only the restore table")
    parser.add_argument("--out", default=str(_results.default_path("storage_requests")), help="where the results go")
    args = parser.parse_args(argv)
    from ray_goodput.testing._s3 import start_moto_server

    meta = _results.start_run("storage_requests", argv)
    modes = [] if args.restore_only else ["eager", "lazy"] if args.open == "both" else [args.open]
    proc, endpoint = start_moto_server()
    try:
        tables = {
            mode: [(world, count(endpoint, world, args.saves, eager_open=mode == "eager")) for world in args.worlds]
            for mode in modes
        }
        restores = [(world, restore_bytes(endpoint, world, args.layers, args.block_kib)) for world in args.worlds]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    table = _report(tables, restores, args)
    print(table)
    _results.write(
        args.out,
        meta,
        {
            "args": vars(args),
            "markdown": table,
            "requests_per_checkpoint": {
                mode: {str(world): dict(c) for world, c in rows} for mode, rows in tables.items()
            },
            "restore_bytes": {str(world): ranks for world, ranks in restores},
        },
    )
    print(f"\nresults written to {args.out}")
    return 0


def _report(
    tables: dict[str, list[tuple[int, Counter]]], restores: list[tuple[int, list[dict]]], args: argparse.Namespace
) -> str:
    lines = []
    for mode, rows in tables.items():
        lines += ["", f"S3 streams opened {'at once (pyarrow default)' if mode == 'eager' else 'lazily'}:", ""]
        lines += _table(rows) + [""] + _growth_verdict(mode, rows)
    if len(tables) == 2:
        lines += ["", "| world | total, eager | total, lazy | lazy / eager |", "|---|---|---|---|"]
        for (world, eager), (_, lazy) in zip(tables["eager"], tables["lazy"]):
            e, z = _total(eager), _total(lazy)
            lines.append(f"| {world} | {e:.1f} | {z:.1f} | {z / e:.2f}x |")
    lines += [
        "",
        f"Bytes read per rank at a cold restore from S3 (FSDP2 MLP, {args.layers} x 512 x 512 + "
        f"AdamW, blocks of {args.block_kib} KiB):",
        "",
    ]
    return "\n".join(lines + _restore_table(restores))


def _growth_verdict(mode: str, rows: list[tuple[int, Counter]]) -> list[str]:
    """Requests per checkpoint from the smallest world to the largest, against the worlds' growth."""
    if len(rows) < 2:
        return []
    (w0, c0), (w1, c1) = min(rows, key=lambda r: r[0]), max(rows, key=lambda r: r[0])
    growth = _total(c1) / _total(c0)
    ratio = growth / (w1 / w0)
    return [
        f"- {mode}: requests per checkpoint grow {growth:.2f}× from world {w0} to {w1} ({w1 / w0:g}× the "
        f"ranks) = {ratio:.2f}× linear → {_targets.load('storage_requests')['growth'].verdict(ratio)}"
    ]


def _total(counts: Counter) -> float:
    return sum(v for m, v in counts.items() if m != "marker GETs")


def _table(rows: list[tuple[int, Counter]]) -> list[str]:
    methods = sorted({m for _, c in rows for m in c} - {"marker GETs"}) + ["marker GETs"]
    out = [
        "| world | " + " | ".join(methods) + f" | total / checkpoint | per rank | vs world {rows[0][0]} |",
        "|---|" + "---|" * (len(methods) + 3),
    ]
    base = _total(rows[0][1])
    for world, counts in rows:
        total = _total(counts)
        cells = " | ".join(f"{counts.get(m, 0):.1f}" for m in methods)
        out.append(f"| {world} | {cells} | {total:.1f} | {total / world:.1f} | {total / base:.2f}x |")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
