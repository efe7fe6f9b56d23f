"""A node removed mid-upload: the run resumes on the remaining node, on fewer workers
(elastic ScalingConfig), from the newest committed checkpoint (resharded 2 -> 1)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from ray_goodput import list_checkpoints

STEPS, EVERY, TRIGGER_STEP = 24, 4, 12


def _loop(config: dict) -> None:
    import torch
    import ray.train
    from ray.train.torch import prepare_model

    from ray_goodput import Checkpointer, list_checkpoints

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)))
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = Path(config["dir"])
    with Checkpointer(config["uri"], keep_last=10) as ckpt:
        newest = max((i.step for i in list_checkpoints(config["uri"]) if i.committed), default=None)
        restored = ckpt.restore({"model": model, "optim": optim})
        if rank == 0:
            (out / f"attempt-{os.getpid()}.json").write_text(json.dumps(
                {"world": world, "restored": restored, "newest_committed": newest}))
        for step in range((restored or 0) + 1, STEPS + 1):
            loss = model(torch.randn(8, 1024)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            if step % EVERY == 0:
                ckpt.save(step, {"model": model, "optim": optim})
            if world == 2 and step == TRIGGER_STEP and rank == 1:
                (out / "trigger").write_text(ray.get_runtime_context().get_node_id())
            if world == 2 and step >= TRIGGER_STEP:
                time.sleep(1.0)  # give the test time to pull the node


def test_node_lost_mid_upload_resumes_on_fewer_workers(tmp_path, s3_server):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes = [cluster.add_node(num_cpus=2, resources={"slot": 1}) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}})
    try:
        cluster.wait_for_nodes()
        uri = s3_server.bucket_uri("node-loss")
        trainer = TorchTrainer(
            _loop, train_loop_config={"uri": uri, "dir": str(tmp_path)},
            scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1, "slot": 1}),
            run_config=RunConfig(name="node-loss", storage_path=str(tmp_path / "ray"),
                                 failure_config=FailureConfig(max_failures=3)),
        )
        box: dict = {}
        fit = threading.Thread(target=lambda: box.update(result=trainer.fit()))
        fit.start()
        trigger = tmp_path / "trigger"
        deadline = time.time() + 300
        while not trigger.exists() and time.time() < deadline:
            time.sleep(0.05)
        victim = next(n for n in nodes if n.node_id == trigger.read_text())
        cluster.remove_node(victim, allow_graceful=False)  # kills its workers and uploader
        fit.join(timeout=400)
        assert not fit.is_alive() and "result" in box
        attempts = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("attempt-*.json"))]
        assert attempts[0] == {"world": 2, "restored": None, "newest_committed": None}
        resumed = [a for a in attempts if a["world"] == 1]
        assert resumed, attempts
        # Resumed from the newest committed checkpoint that existed, never a partial one.
        assert resumed[0]["restored"] == resumed[0]["newest_committed"] >= EVERY * 2
        final = [i for i in list_checkpoints(uri) if i.committed]
        assert final[-1].step == STEPS and final[-1].world_size == 1
        assert any(i.world_size == 2 for i in final)
    finally:
        ray.shutdown()
        cluster.shutdown()
