"""Checkpointer inside a real Ray Train run: the quickstart (failure + resume). A custom S3
storage_path outside the run directory is the fake-multinode launch's storage
(``test_cluster_launch.py``)."""

from __future__ import annotations

import pytest

from ray_goodput import list_checkpoints


@pytest.mark.slow
def test_quickstart_resumes_from_last_committed(ray_local, tmp_path, capsys):
    import time as _time

    import mlflow

    from ray_goodput.cli import main as cli_main
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
    assert g["work_steps"] == 40  # every kept step was computed in this job, at full capacity
    assert g["seconds"]["productive"] > 0 and g["seconds"]["restart_downtime"] > 0
    assert g["seconds"]["lost"] > 0 and g["seconds"]["restore"] > 0
    # One MLflow run with the breakdown and its chart; `ray-goodput report` reads it back.
    client = mlflow.MlflowClient(tracking_uri=out["tracking_uri"])
    exp = client.get_experiment_by_name("ray_goodput")
    (mrun,) = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{out['name']}'")
    assert mrun.info.status == "FINISHED"
    assert mrun.data.metrics["goodput/steps_lost"] == g["steps_lost"]
    assert mrun.data.metrics["goodput/work_steps"] == g["work_steps"]
    assert {a.path for a in client.list_artifacts(mrun.info.run_id)} >= {
        "goodput_breakdown.png",
        "goodput_timeline.png",
        "goodput_summary.json",
    }
    assert "failure_1" in mrun.data.tags
    # The data wait per step travels as a series next to goodput (from the step events).
    waits = client.get_metric_history(mrun.info.run_id, "data/fetch_seconds_p95")
    assert waits and all(m.value >= 0 for m in waits)
    assert g["isolated_nodes"] == [] and g["stopped"] is None  # the Recovery saw no bad node
    # (in-process through the CLI's main: test_cli runs the entry point as a process)
    capsys.readouterr()
    assert cli_main(["report", out["name"], "--tracking-uri", out["tracking_uri"]]) == 0
    report = capsys.readouterr().out
    assert "restart_downtime" in report, report
