"""A cluster that grows under the job: Ray's ``fake_multinode`` autoscaler provider.

``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=tests/fake_cluster.yaml`` starts
a head with no CPUs; a driver script (this file, run as ``__main__``) connects with
``ray.init(address=...)`` and fits a ``ray_goodput.TorchTrainer`` with two one-CPU workers,
so the autoscaler has to launch two nodes (real raylets on this machine) before any worker
runs. The job checkpoints with ``Checkpointer`` to a custom S3 endpoint (moto's server,
outside the run directory) and reads a ``FileDataset`` through the ``DataLoader``, which
starts each node's uploader and cache actor. The test then checks that the training
finished on autoscaled nodes only and that each of them got exactly one
``uploader:<node_id>`` and one ``cache:<node_id>`` actor, which found the staging and
cache directories exported to ``ray start`` (as ``cluster.yaml`` exports them); that the
run's reported checkpoint is a pointer to the S3 checkpoint, endpoint included; and that
each uploader exits on its own once its workers closed.

Everything Ray runs in subprocesses, never in the pytest process, so the suite's shared
Ray instances are not involved. Teardown ends the processes of this cluster only (tagged
by an environment variable that every Ray process inherits); ``ray stop --force`` would
also end every other Ray instance of the user on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = Path(__file__).with_name("fake_cluster.yaml")
TAG_VAR = "RAY_GOODPUT_FAKE_CLUSTER_TAG"
NAMESPACE = "ray_goodput"
START_TIMEOUT_S = 90
DRIVER_TIMEOUT_S = 300
STOP_TIMEOUT_S = 15
NUM_FILES, FEATURES, BATCH, EPOCHS = 8, 4, 2, 2


# ---- the driver (run as a subprocess: python tests/test_cluster_launch.py ...) -------------


def _decode(raw: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


def _snapshot(out: Path, step: int) -> None:
    """Rank 0 lists the node actors while every rank still holds its Checkpointer and
    DataLoader (an uploader exits 2 s after its last client closes)."""
    import ray
    import torch.distributed as dist

    node = ray.get_runtime_context().get_node_id()
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    if dist.get_rank() == 0:
        names = sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE
        )
        out.write_text(json.dumps({"rank_nodes": nodes, "actors": names, "steps": step}))
    dist.barrier()  # the other ranks keep their clients open until the listing is done


def _train(config: dict[str, Any]) -> None:
    import torch
    from ray.train.torch import prepare_model
    from torch import nn

    from ray_goodput import Checkpointer
    from ray_goodput.data import CacheConfig, DataLoader, FileDataset

    torch.set_num_threads(1)
    dataset = FileDataset(config["data"], decode=_decode, seed=0, cache=CacheConfig(capacity_bytes=1 << 26))
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=0)
    model = prepare_model(nn.Linear(FEATURES, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim, "loader": loader}
    step = 0
    with Checkpointer(config["uri"], keep_last=2) as ckpt:
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for batch in loader:
                loss = model(batch).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                step += 1
            ckpt.save(step, state, metrics={"loss": loss.item()})
        ckpt.wait()
        _snapshot(Path(config["out"]), step)


def _alive_nodes() -> dict[str, float]:
    import ray

    return {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]}


def _drive(address: str, data: str, work: Path, uri: str) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    import ray_goodput
    from ray_goodput.checkpoint.save._ray_report import POINTER_FILE
    from ray_goodput.data import cache_status
    from ray_goodput.runtime import _services

    ray.init(address=address, logging_level="WARNING")
    head = ray.get_runtime_context().get_node_id()
    before = _alive_nodes()
    print(f"head {head} ({before.get(head, 0):g} CPUs); nodes before fit: {len(before)}", flush=True)
    started = time.monotonic()
    trainer = ray_goodput.TorchTrainer(
        _train,
        train_loop_config={"data": data, "out": str(work / "in_loop.json"), "uri": uri},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name="fake",
            storage_path=str(work / "runs"),
            failure_config=FailureConfig(max_failures=0, controller_failure_limit=1),
        ),
    )
    result = trainer.fit()
    fit_s = time.monotonic() - started
    seen = json.loads((work / "in_loop.json").read_text())
    committed = [(c.step, c.world_size) for c in ray_goodput.list_checkpoints(uri) if c.committed]
    steps = [step for step, _ in committed]
    with result.checkpoint.as_directory() as d:
        pointer = json.loads((Path(d) / POINTER_FILE).read_text())["uri"]
    deadline = time.monotonic() + 30  # an uploader exits ~2 s after its last client closed
    while _services.find("uploader") and time.monotonic() < deadline:
        time.sleep(0.2)
    uploaders_left = sorted(_services.find("uploader"))
    after = _alive_nodes()
    caches = {c["node_id"]: c.get("directory") for c in cache_status()}
    for rank, node in enumerate(seen["rank_nodes"]):
        print(f"rank {rank} ran on node {node} ({after.get(node, 0):g} CPU)", flush=True)
    print(f"actors in namespace {NAMESPACE}: {' '.join(seen['actors'])}", flush=True)
    print(f"fit {fit_s:.1f}s, {seen['steps']} steps, committed checkpoints {steps}, error {result.error!r}", flush=True)
    (work / "driver.json").write_text(
        json.dumps(
            {
                "head": head,
                "before": before,
                "after": after,
                "fit_s": fit_s,
                "error": repr(result.error),
                "committed": steps,
                "world_sizes": [w for _, w in committed],
                "caches": caches,
                "pointer": pointer,
                "uploaders_left": uploaders_left,
                **seen,
            }
        )
    )


# ---- the cluster -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _tagged_pids(tag: str) -> list[int]:
    """Our processes: every Ray process of the cluster inherits ``TAG_VAR=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return pids


def _end_tagged(tag: str) -> list[int]:
    """SIGKILL every process of the cluster, as ``ray stop --force`` does, but only ours;
    returns the pids still there after ``STOP_TIMEOUT_S`` (none)."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (pids := _tagged_pids(tag)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return _tagged_pids(tag)


class FakeCluster:
    """A head started by ``ray start`` with the fake_multinode autoscaler, in ``work``."""

    def __init__(self, work: Path) -> None:
        import yaml
        from ray.util import get_node_ip_address

        self.work = work
        self.tag = uuid.uuid4().hex
        port = _free_port()
        self.address = f"{get_node_ip_address()}:{port}"
        config = yaml.safe_load(CONFIG.read_text())
        config["provider"]["gcs_address"] = self.address  # else it assumes port 6379
        (work / "cluster.yaml").write_text(yaml.safe_dump(config))
        token = work / "auth_token"  # token auth on, with this cluster's own token
        token.write_text(secrets.token_hex(32))
        self.env = {
            **os.environ,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            TAG_VAR: self.tag,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            # the controller waits for the autoscaler (slow on a loaded machine)
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "150",
            "RAY_GOODPUT_STAGING_DIR": str(work / "staging"),
            "RAY_GOODPUT_CACHE_DIR": str(work / "cache"),
        }
        self.command = [
            "ray",
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=0",
            f"--autoscaling-config={work / 'cluster.yaml'}",
            f"--temp-dir={work / 'ray'}",
            "--include-dashboard=false",
            f"--ray-client-server-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            "--object-store-memory=100000000",
        ]

    def start(self) -> str:
        done = subprocess.run(self.command, env=self.env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        assert done.returncode == 0, f"ray start failed:\n{done.stdout}\n{done.stderr}"
        print("RAY_FAKE_CLUSTER=1", " ".join(self.command))
        return done.stdout

    def drive(self, data: Path, uri: str) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            __file__,
            "--address",
            self.address,
            "--data",
            str(data),
            "--work",
            str(self.work),
            "--uri",
            uri,
        ]
        try:
            return subprocess.run(
                command, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"the driver did not finish within {DRIVER_TIMEOUT_S}s; output:\n{exc.stdout}\n{exc.stderr}"
            ) from exc

    def stop(self) -> list[int]:
        return _end_tagged(self.tag)


@pytest.fixture
def fake_cluster():
    work = Path(tempfile.mkdtemp(prefix="rgfc-"))  # short: Ray's socket paths live under it
    cluster = FakeCluster(work)
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
        assert not left, f"processes of the fake cluster still alive after SIGKILL: {left}"


def _write_files(root: Path) -> Path:
    import numpy as np

    root.mkdir()
    for i in range(NUM_FILES):
        (root / f"sample-{i:02d}.bin").write_bytes(np.full(FEATURES, i, dtype=np.float32).tobytes())
    return root


@pytest.mark.slow
@pytest.mark.cluster
def test_quickstart_runs_on_autoscaled_nodes_with_one_uploader_and_cache_each(fake_cluster, s3_server):
    uri = s3_server.bucket_uri("fake")
    run = fake_cluster.drive(_write_files(fake_cluster.work / "data"), uri)
    print(run.stdout)  # the driver's summary lines (shown with -s, or on failure)
    assert run.returncode == 0, f"driver failed:\n{run.stdout}\n{run.stderr[-6000:]}"
    out = json.loads((fake_cluster.work / "driver.json").read_text())
    assert out["error"] == "None"
    # Step 2 may be superseded by step 4 in a slow node uploader's lane (by design: the
    # newest save goes next), so step 4 is the one that must be there.
    assert out["committed"][-1] == 4 and set(out["committed"]) <= {2, 4}, out
    assert set(out["world_sizes"]) == {2}, out
    head, nodes = out["head"], out["rank_nodes"]
    assert out["before"] == {head: 0.0}, "the cluster must start as a head without CPUs"
    assert len(set(nodes)) == 2 and head not in nodes, nodes  # one autoscaled node per worker
    assert all(out["after"].get(n) == 1.0 for n in nodes), out["after"]
    expected = sorted(f"{kind}:{n}" for n in nodes for kind in ("uploader", "cache"))
    assert out["actors"] == expected
    cache_dir = str(fake_cluster.work / "cache")
    assert out["caches"] == {n: cache_dir for n in nodes}, "the exported cache dir must reach the actor"
    assert any((fake_cluster.work / "staging").rglob("*")), "nothing was staged in the exported dir"
    # The checkpoint on custom S3 storage, outside the run directory: Ray Train's result
    # points to it (endpoint included) and each node's uploader exited once its workers closed.
    assert urlsplit(out["pointer"]).path.endswith("fake/checkpoints/step-000000004"), out["pointer"]
    assert "endpoint_override=" in out["pointer"]
    assert out["uploaders_left"] == [], out["uploaders_left"]


def _main() -> None:
    parser = argparse.ArgumentParser(description="driver of test_cluster_launch")
    parser.add_argument("--address", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--uri", required=True)
    args = parser.parse_args()
    _drive(args.address, args.data, args.work, args.uri)


if __name__ == "__main__":
    _main()
