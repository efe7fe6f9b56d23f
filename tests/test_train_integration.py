"""Checkpointer inside real Ray Train runs: the quickstart (failure + resume) and a
custom S3 storage_path outside the run directory."""

from __future__ import annotations

import json
import os
import time

import pytest

from ray_goodput import list_checkpoints
from ray_goodput.checkpoint._ray_report import POINTER_FILE


@pytest.mark.slow
def test_quickstart_resumes_from_last_committed(ray_local, tmp_path):
    import subprocess
    import sys
    import time as _time

    import mlflow

    from ray_goodput.demo import run

    started = _time.time()
    out = run(tmp_path, steps=40, every=10, fail_at=25)
    wall = _time.time() - started
    assert out["last_step"] == 40
    assert len(out["resumes"]) == 1
    resume = out["resumes"][0]
    committed = {i.step for i in list_checkpoints(out["run_dir"]) if i.committed}
    assert resume["from_step"] in (10, 20) and resume["lost"] == 25 - resume["from_step"]
    # Result.checkpoint is the newest committed checkpoint, in place (NO_UPLOAD).
    assert out["checkpoint"].endswith("checkpoints/step-000000040") and 40 in committed
    assert max(committed) == 40 and len(committed) <= 2  # keep_last=2

    # The goodput ledger adds up and matches what actually happened.
    g = out["goodput"]
    assert g["finished"] and g["attempts"] == 2 and g["failures"] >= 1
    assert abs(sum(g["seconds"].values()) - g["total_s"]) <= 0.01 * g["total_s"]
    assert 0.5 * wall < g["total_s"] <= wall  # job start to the last event, within fit()
    assert g["steps_lost"] == resume["lost"] and g["steps_kept"] == 40
    assert g["seconds"]["productive"] > 0 and g["seconds"]["restart_downtime"] > 0
    assert g["seconds"]["lost"] > 0 and g["seconds"]["restore"] > 0
    # One MLflow run with the breakdown and its chart; `ray-goodput report` reads it back.
    client = mlflow.MlflowClient(tracking_uri=out["tracking_uri"])
    exp = client.get_experiment_by_name("ray_goodput")
    (mrun,) = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{out['name']}'")
    assert mrun.info.status == "FINISHED"
    assert mrun.data.metrics["goodput/steps_lost"] == g["steps_lost"]
    assert {a.path for a in client.list_artifacts(mrun.info.run_id)} >= {
        "goodput_breakdown.png", "goodput_timeline.png", "goodput_summary.json"}
    assert "failure_1" in mrun.data.tags
    # The data wait per step travels as a series next to goodput (from the step events).
    waits = client.get_metric_history(mrun.info.run_id, "data/fetch_seconds_p95")
    assert waits and all(m.value >= 0 for m in waits)
    assert g["isolated_nodes"] == [] and g["stopped"] is None  # the Recovery saw no bad node
    report = subprocess.run([sys.executable, "-m", "ray_goodput.cli", "report", out["name"],
                             "--tracking-uri", out["tracking_uri"]], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "restart_downtime" in report.stdout, report.stdout + report.stderr


def _s3_loop(config):
    import torch

    from ray_goodput import Checkpointer

    model = torch.nn.Linear(4, 4)
    with Checkpointer(config["uri"]) as ckpt:
        assert ckpt.restore({"model": model}) is None
        for step in (1, 2):
            ckpt.save(step, {"model": model})


@pytest.mark.slow
def test_custom_s3_storage_reports_pointer_checkpoint(ray_local, tmp_path, s3_server):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    uri = s3_server.bucket_uri("custom")
    trainer = TorchTrainer(
        _s3_loop, train_loop_config={"uri": uri},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="s3run", storage_path=str(tmp_path),
                             failure_config=FailureConfig(max_failures=0)),
    )
    result = trainer.fit()
    assert [(i.step, i.committed, i.world_size) for i in list_checkpoints(uri)] == [(1, True, 2), (2, True, 2)]
    with result.checkpoint.as_directory() as d:
        pointer = json.load(open(os.path.join(d, POINTER_FILE)))
    from urllib.parse import urlsplit

    assert urlsplit(pointer["uri"]).path.endswith("custom/checkpoints/step-000000002")
    assert "endpoint_override=" in pointer["uri"]  # the URI still reaches the custom endpoint
    # The node uploader used by the run exits on its own once its workers closed.
    from ray_goodput.runtime import _services

    deadline = time.time() + 20
    while _services.find("uploader") and time.time() < deadline:
        time.sleep(0.2)
    assert _services.find("uploader") == {}
