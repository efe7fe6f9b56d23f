"""Data loading throughput: stock torch DataLoader over S3 vs ray_goodput vs a local dir.

Starts its own S3 server (moto, in a subprocess), writes ``--files`` small files (and a
Parquet set), then measures samples/s per epoch and, with a simulated compute per batch,
the share of steps that waited for data. Prints a markdown table and writes the results
to ``benchmarks/results/data_throughput_cpu.json`` (``--out``).

    python benchmarks/data_throughput.py --files 10000 --file-kb 100
    python benchmarks/data_throughput.py --files 300 --file-kb 4 --stock-samples 100 --compute-batches 20 \
        --parquet-rows 2000 --out /tmp/data_throughput.json     # smoke
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _results
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import torch.utils.data

from ray_goodput.data import CacheConfig, DataLoader, FileDataset, ParquetDataset
from ray_goodput.runtime import _services
from ray_goodput.testing._s3 import start_moto_server

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def start_moto() -> tuple[subprocess.Popen, str]:
    return start_moto_server()


def write_files(fs: pafs.FileSystem, bucket: str, local: Path, n: int, size: int) -> None:
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 255, size, dtype=np.uint8).tobytes()
    local.mkdir(parents=True)

    def one(i: int) -> None:
        data = i.to_bytes(8, "little") + payload[8:]
        (local / f"f{i:06d}.bin").write_bytes(data)
        with fs.open_output_stream(f"{bucket}/files/f{i:06d}.bin") as out:
            out.write(data)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(n)))


def write_parquet(fs: pafs.FileSystem, bucket: str, files: int, rows: int) -> None:
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows)
        table = pa.table({"id": ids, "x": ids * 0.5, "y": (ids % 7).astype(np.int32)})
        with fs.open_output_stream(f"{bucket}/parquet/p{f:03d}.parquet") as out:
            pq.write_table(table, out, row_group_size=rows // 4)


class StockS3Dataset(torch.utils.data.Dataset):
    """What people write first: open each file on storage at every access."""

    def __init__(self, endpoint: str, paths: list[str]) -> None:
        self.endpoint, self.paths, self.fs = endpoint, paths, None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        if self.fs is None:
            self.fs = pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http")
        with self.fs.open_input_file(self.paths[i]) as f:
            return len(f.read())


class LocalDataset(torch.utils.data.Dataset):
    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        with open(self.paths[i], "rb") as f:
            return len(f.read())


def timed_epoch(loader, compute_s: float = 0.0, max_batches: int | None = None):
    """(samples/s, waits per batch) of one pass; ``waits`` from our loader only."""
    samples, waits = 0, []
    start = time.perf_counter()
    it = iter(loader)
    while max_batches is None or len(waits) < max_batches:
        t0 = time.perf_counter()
        batch = next(it, None)
        if batch is None:
            break
        waits.append(time.perf_counter() - t0)
        samples += len(batch["id"]) if isinstance(batch, dict) else len(batch)
        if compute_s:
            time.sleep(compute_s)
    del it
    return samples / (time.perf_counter() - start), waits


def run(args) -> list[tuple[str, float, float]]:
    rows = []
    work = Path(tempfile.mkdtemp(prefix="rg-bench-"))
    proc, endpoint = start_moto()
    try:
        fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)
        fs.create_dir("bench")
        t = time.time()
        write_files(fs, "bench", work / "local", args.files, args.file_kb * 1024)
        write_parquet(fs, "bench", args.parquet_files, args.parquet_rows)
        print(f"wrote {args.files} files in {time.time() - t:.0f}s", file=sys.stderr)
        ray.init(
            address="local", num_cpus=4, include_dashboard=False, log_to_driver=False
        )  # first: every loader runs beside the same Ray daemons
        uri = f"s3://bench/files?endpoint_override={endpoint}&scheme=http"
        kw = dict(batch_size=args.batch, num_workers=args.workers)
        paths = sorted(f"bench/files/{p.name}" for p in (work / "local").iterdir())
        stock_n = min(args.stock_samples, len(paths))
        stock = torch.utils.data.DataLoader(StockS3Dataset(endpoint, paths[:stock_n]), shuffle=True, **kw)
        rows.append(
            (
                f"stock torch DataLoader, S3 every access ({stock_n} samples)",
                timed_epoch(stock)[0],
                timed_epoch(stock)[0],
            )
        )
        local = torch.utils.data.DataLoader(LocalDataset(sorted((work / "local").iterdir())), shuffle=True, **kw)
        rows.append(("stock torch DataLoader, local directory (floor)", timed_epoch(local)[0], timed_epoch(local)[0]))
        cache = CacheConfig(directory=str(work / "cache"), lookahead=args.lookahead, fetch_concurrency=args.concurrency)
        ds = FileDataset(uri, decode=len, cache=cache)
        loader = DataLoader(ds, collate_fn=list, **kw)
        cold, warm = timed_epoch(loader)[0], timed_epoch(loader)[0]
        rows.append(("ray_goodput FileDataset, S3 (cold cache, then warm)", cold, warm))
        per_batch_fetch = args.batch / cold
        compute = args.compute_ms / 1000 if args.compute_ms else 1.5 * per_batch_fetch
        _services.shutdown("cache", drain_timeout_s=10)
        shutil.rmtree(work / "cache")
        ds2 = FileDataset(uri, decode=len, seed=1, cache=cache)
        loader2 = DataLoader(ds2, collate_fn=list, **kw)
        _, waits = timed_epoch(loader2, compute, args.compute_batches)
        _, floor_waits = timed_epoch(local, compute, args.compute_batches)
        warmup = -(-args.lookahead // args.batch)  # steps that fill the first window
        extra = dict(
            compute_ms=compute * 1000,
            per_batch_fetch_ms=per_batch_fetch * 1000,
            steps=len(waits),
            warmup=warmup,
            waited=_share(waits[warmup:], 0.001),
            waited_all=_share(waits, 0.001),
            waited10=_share(waits[warmup:], 0.010),
            floor_waited=_share(floor_waits[warmup:], 0.001),
            floor_waited10=_share(floor_waits[warmup:], 0.010),
        )
        pq_uri = f"s3://bench/parquet?endpoint_override={endpoint}&scheme=http"
        pds = ParquetDataset(pq_uri, cache=cache)
        ploader = DataLoader(pds, batch_size=args.parquet_batch, num_workers=args.workers)
        rows.append(
            ("ray_goodput ParquetDataset rows/s (cold, then warm)", timed_epoch(ploader)[0], timed_epoch(ploader)[0])
        )
        return rows, extra
    finally:
        if ray.is_initialized():
            _services.shutdown("cache", drain_timeout_s=10)
            ray.shutdown()
        proc.terminate()
        shutil.rmtree(work, ignore_errors=True)


def _share(waits: list[float], threshold_s: float) -> float:
    return float(np.mean(np.array(waits) > threshold_s)) if waits else 0.0


def report(rows, extra, args) -> str:
    stock2, floor2 = rows[0][2], rows[1][2]
    lines = [
        f"{args.files} files x {args.file_kb} KB, batch {args.batch}, "
        f"{args.workers} loader workers, local moto S3 server",
        "",
        "| loader | epoch 1 samples/s | epoch 2 samples/s | epoch 2 vs stock S3 | epoch 2 vs local floor |",
        "|---|---|---|---|---|",
    ]
    for name, e1, e2 in rows:
        ratio = "-" if "Parquet" in name else f"{e2 / stock2:.1f}x"
        floor = "-" if "Parquet" in name else f"{e2 / floor2:.2f}x"
        lines.append(f"| {name} | {e1:,.0f} | {e2:,.0f} | {ratio} | {floor} |")
    lines += [
        "",
        f"Epoch 1, cold cache, {extra['compute_ms']:.0f} ms simulated compute per "
        f"batch (cold per-batch fetch without compute: {extra['per_batch_fetch_ms']:.0f} "
        f"ms), steps {extra['warmup']}..{extra['steps']} (after the first prefetch "
        "window):",
        "",
        "| loader | steps waiting > 1 ms | steps waiting > 10 ms |",
        "|---|---|---|",
        f"| ray_goodput, S3, cold cache | {extra['waited']:.1%} | {extra['waited10']:.1%} |",
        f"| stock, local directory (same compute) | {extra['floor_waited']:.1%} | {extra['floor_waited10']:.1%} |",
        "",
        f"Counting the first {extra['warmup']} steps too: {extra['waited_all']:.1%} "
        "of ray_goodput steps waited > 1 ms.",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=10000)
    p.add_argument("--file-kb", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--lookahead", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--stock-samples", type=int, default=2000, help="samples the stock S3 loader reads per epoch (it is slow)"
    )
    p.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="simulated compute per batch; default 1.5x the cold per-batch fetch",
    )
    p.add_argument("--compute-batches", type=int, default=150)
    p.add_argument("--parquet-files", type=int, default=8)
    p.add_argument("--parquet-rows", type=int, default=100_000)
    p.add_argument("--parquet-batch", type=int, default=1024)
    p.add_argument("--out", default=str(_results.default_path("data_throughput")), help="where the results go")
    args = p.parse_args()
    meta = _results.start_run("data_throughput")
    rows, extra = run(args)
    table = report(rows, extra, args)
    print(table)
    _results.write(
        args.out,
        meta,
        {
            "args": vars(args),
            "markdown": table,
            "extra": extra,
            "rows": [{"loader": n, "epoch1": e1, "epoch2": e2} for n, e1, e2 in rows],
        },
    )
    print(f"\nresults written to {args.out}")


if __name__ == "__main__":
    main()
