"""Image classification from object storage: a stock PyTorch DataLoader that reads every
file from storage on each access, against ray_goodput's FileDataset + node cache +
DataLoader. Same JPEGs, same decode and augmentation, same CNN, same batch size and
loader workers; two epochs each.

    python examples/image_classification.py --smoke             # local S3 server, ~1 min
    python examples/image_classification.py --dataset s3://bucket/train/ --images 0

Without ``--storage``/``--dataset`` it starts a local S3 server (moto, over HTTP) and
writes N JPEGs into it with Pillow. Labels travel inside each JPEG (its comment marker,
written by the generator); images without one train with label 0: this example measures
data loading, not accuracy. ``fetch_seconds`` per step goes to MLflow (sqlite under --out).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

CLASSES = 10
CROP = 56
WAIT_S = 0.010  # a step "waited for data" when its batch took longer than this to arrive


# -- samples: JPEG bytes -> (augmented image tensor, label) --
def decode(data: bytes) -> tuple[torch.Tensor, int]:
    """Decode, random-crop to CROP x CROP, random horizontal flip, normalize."""
    import numpy as np
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    label = int(img.info.get("comment", b"0") or 0)
    x = torch.from_numpy(np.array(img.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1)
    top, left = (int(v) for v in torch.randint(0, x.shape[1] - CROP + 1, (2,)))
    x = x[:, top : top + CROP, left : left + CROP]
    if torch.rand(()) < 0.5:
        x = x.flip(2)
    return (x.float() / 127.5 - 1.0), label


def make_images(uri: str, count: int, side: int) -> None:
    """``count`` JPEGs of CLASSES patterns (hue + stripe direction + noise) under ``uri``."""
    import numpy as np
    from PIL import Image

    from ray_goodput.storage import resolve, write_bytes

    loc, rng = resolve(uri), np.random.default_rng(0)
    yy, xx = np.mgrid[0:side, 0:side]
    for i in range(count):
        k = i % CLASSES
        stripes = np.sin((xx * np.cos(k) + yy * np.sin(k)) / 3.0)[..., None]
        color = np.array([k * 25, 255 - k * 20, (k * 67) % 256])
        pixels = 128 + 0.4 * stripes * color + rng.normal(0, 30, (side, side, 3))
        buf = io.BytesIO()
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90, comment=str(k))
        write_bytes(loc, f"class-{k}/img-{i:06d}.jpg", buf.getvalue())


class StockImages(torch.utils.data.Dataset):
    """What many jobs do: list the files once, read each from storage on every access."""

    def __init__(self, uri: str) -> None:
        import pyarrow.fs as pafs

        from ray_goodput.storage import list_dir, resolve

        self.loc = resolve(uri)
        self.paths = sorted(
            i.path
            for i in list_dir(self.loc, recursive=True)
            if i.type == pafs.FileType.File and i.path.endswith(".jpg")
        )

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with self.loc.fs.open_input_file(self.paths[index]) as f:
            return decode(f.read())


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(  # small on purpose: the loaders, not the GPU-less compute, are measured
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )


def train_epochs(loader: Any, epochs: int, fetch_s: Any) -> list[dict[str, Any]]:
    """Train ``epochs`` epochs; ``fetch_s(loader, measured)`` is how long the last batch
    took to arrive. Returns per epoch: images/s, per-step fetch seconds, mean loss."""
    model = make_cnn()
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        fetches, losses, images, t0 = [], [], 0, time.perf_counter()
        it, mark = iter(loader), time.perf_counter()
        for x, y in it:
            fetches.append(fetch_s(loader, time.perf_counter() - mark))
            loss = nn.functional.cross_entropy(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
            images += len(y)
            mark = time.perf_counter()
        wall = time.perf_counter() - t0
        out.append({"images_s": images / wall, "fetch": fetches, "loss": sum(losses) / max(1, len(losses))})
    return out


def run_stock(uri: str, batch: int, workers: int, epochs: int) -> list[dict[str, Any]]:
    ds = StockImages(uri)
    print(f"{len(ds)} JPEGs under {uri.split('?')[0]}", flush=True)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers, persistent_workers=workers > 0
    )
    return train_epochs(loader, epochs, lambda _loader, measured: measured)


def run_ray_goodput(uri: str, batch: int, workers: int, epochs: int, cache_dir: str) -> list[dict[str, Any]]:
    from ray_goodput.data import CacheConfig, DataLoader, FileDataset

    ds = FileDataset(uri, decode=decode, suffixes=(".jpg",), seed=0, cache=CacheConfig(directory=cache_dir))
    loader = DataLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=workers > 0)
    results = train_epochs(loader, epochs, lambda ld, _measured: ld.last_fetch_seconds)
    _print_cache()
    return results


def _print_cache() -> None:
    from ray_goodput.data import cache_status

    for c in cache_status():
        print(
            f"node cache: {c.get('files')} files, {c.get('bytes_used', 0) / 2**20:.1f} MiB, "
            f"{c.get('bytes_fetched', 0) / 2**20:.1f} MiB fetched from storage, hits {c.get('hits')}, "
            f"misses {c.get('misses')}, errors {c.get('errors') or c.get('error') or 0}",
            flush=True,
        )


def log_mlflow(out: Path, results: dict[str, list[dict[str, Any]]]) -> str:
    """Per-step ``fetch_seconds`` series and per-epoch images/s, one MLflow run."""
    import mlflow
    from mlflow.entities import Metric

    uri = f"sqlite:///{out}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("image_classification")
    exp_id = (
        exp.experiment_id
        if exp
        else client.create_experiment("image_classification", artifact_location=(out / "mlartifacts").as_uri())
    )
    run_id = client.create_run(exp_id, run_name=f"loaders-{time.strftime('%Y%m%d-%H%M%S')}").info.run_id
    now = int(time.time() * 1000)
    for name, epochs in results.items():
        fetches = [f for e in epochs for f in e["fetch"]]
        metrics = [Metric(f"{name}/fetch_seconds", f, now, i) for i, f in enumerate(fetches)]
        metrics += [Metric(f"{name}/images_per_s", e["images_s"], now, i + 1) for i, e in enumerate(epochs)]
        for i in range(0, len(metrics), 900):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(run_id, metrics=metrics[i : i + 900])
    client.set_terminated(run_id)
    return uri


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    def waited(e: dict[str, Any]) -> str:
        return f"{sum(f > WAIT_S for f in e['fetch']) / max(1, len(e['fetch'])):.0%}"

    rows = [
        "| loader | epoch 1 | epoch 2 | waited > 10 ms, epoch 1 | waited > 10 ms, epoch 2 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (e1, e2) in results.items():
        rows.append(f"| {name} | {e1['images_s']:,.0f} | {e2['images_s']:,.0f} | {waited(e1)} | {waited(e2)} |")
    return "\n".join(rows)


def _storage(args: argparse.Namespace) -> tuple[str, Any]:
    """The dataset URI, and the S3 server process this example started (or None)."""
    if args.dataset:
        return args.dataset, None
    server = None
    storage = args.storage
    if storage is None:
        import pyarrow.fs as pafs

        from ray_goodput.testing._s3 import start_moto_server

        for key, value in (
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ):
            os.environ.setdefault(key, value)
        server, endpoint = start_moto_server()
        pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True).create_dir("images")
        storage = f"s3://images/train?endpoint_override={endpoint}&scheme=http"
    uri = storage if "://" in storage else str(Path(storage, "train").resolve())
    print(f"writing {args.images} JPEGs ({args.side}x{args.side}) to {uri}", flush=True)
    make_images(uri, args.images, args.side)
    return uri, server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="1000 small images (default 10000)")
    p.add_argument("--dataset", default=None, help="existing directory or s3:// prefix of JPEGs")
    p.add_argument("--storage", default=None, help="where to write generated JPEGs (default: a local S3 server)")
    p.add_argument("--images", type=int, default=None)
    p.add_argument("--side", type=int, default=64, help="generated image side (pixels)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (both loaders)")
    p.add_argument("--out", default="image_runs", help="MLflow db and the node cache directory")
    args = p.parse_args()
    args.images = args.images if args.images is not None else (1000 if args.smoke else 10000)
    run(args)


def run(args: argparse.Namespace) -> None:
    import ray

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the same compute budget for both loaders
    uri, server = _storage(args)
    cache_dir = str(out / f"cache-{uuid.uuid4().hex[:8]}")  # a cold cache: epoch 1 really reads storage
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        results = {"stock": run_stock(uri, args.batch_size, args.workers, 2)}
        print("stock done", flush=True)
        results["ray_goodput"] = run_ray_goodput(uri, args.batch_size, args.workers, 2, cache_dir)
    finally:
        ray.shutdown()
        shutil.rmtree(cache_dir, ignore_errors=True)
        if server is not None:
            server.terminate()
    tracking = log_mlflow(out, results)
    print(f"\nbatch {args.batch_size}, {args.workers} loader workers each; images/s per epoch (compute included):\n")
    print(table(results))
    print(
        f"\nmean loss, last epoch: stock {results['stock'][-1]['loss']:.3f}, "
        f"ray_goodput {results['ray_goodput'][-1]['loss']:.3f}; fetch_seconds per step in MLflow: {tracking}"
    )


if __name__ == "__main__":
    main()
