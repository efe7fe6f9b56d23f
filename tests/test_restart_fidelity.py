"""Restart fidelity, the flagship test: a run with injected failures — a SIGKILL while an
upload is in flight, and a node removed while its upload is in flight so
the run resumes on fewer workers (elastic ScalingConfig), resharded 2 -> 1 — ends with
the same weights, bit for bit, as a run without failures that follows the same schedule
of world sizes; every resume took the newest committed checkpoint, never a partial one;
and every sample of every epoch is seen exactly once by the kept steps.

The only node-loss scenario of the suite (it used to run twice, here and in its own test)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist

from ray_goodput import list_checkpoints
from ray_goodput.checkpoint.protocol._layout import step_dir
from ray_goodput.testing import FailAt, FlakyProxy, publish_file, run_world, wait_for, wait_for_file

SAMPLES, BATCH, EVERY, STEPS, NODE_LOSS_STEP = 48, 4, 4, 30, 20
PULL_TIMEOUT_S = 300  # rank 1 waits this long for the test to pull its node
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _features(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.arange(1, 9, dtype=torch.float64)
    x = torch.sin(ids.double()[:, None] * grid / 7.0)
    return x, torch.cos(ids.double() / 5.0)[:, None]


def _decode(data: bytes) -> int:
    return int(data)


def _loop(config: dict) -> None:
    """One attempt of the training function, on any launcher that set up the process
    group: Ray Train's TorchTrainer (the run with failures) or ``run_world`` (the reference)."""
    from ray_goodput import Checkpointer, list_checkpoints, record_step
    from ray_goodput.data import DataLoader, FileDataset

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    if world > 1:  # as ray.train.torch.prepare_model does on CPU
        model = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(
        FileDataset(config["data"], decode=_decode, seed=3, cache=None), batch_size=BATCH, num_workers=0
    )
    out = Path(config["out"])
    state = {"model": model, "optim": optim, "loader": loader}
    with Checkpointer(config["uri"], keep_last=20) as ckpt:
        newest = max((i.step for i in list_checkpoints(config["uri"]) if i.committed), default=None)
        restored = ckpt.restore(state)
        step = restored or 0
        tag = [f"{time.time():.6f}-{os.getpid()}"]
        dist.broadcast_object_list(tag, src=0)  # one name per attempt, shared by its ranks
        tag = tag[0]
        if rank == 0:  # restore commits a save whose every rank was durable on the way
            after = max((i.step for i in list_checkpoints(config["uri"]) if i.committed), default=None)
            (out / f"attempt-{tag}.json").write_text(
                json.dumps(
                    {"world": world, "restored": restored, "newest_committed": newest, "newest_after_restore": after}
                )
            )
        records = open(out / f"records-{tag}-rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the whole run, closed by the process exit
        faults = [FailAt(**f) for f in config["faults"]]
        while step < config["steps"]:
            for ids in loader:
                step += 1
                x, y = _features(ids)
                loss = torch.nn.functional.mse_loss(model(x), y)
                optim.zero_grad()
                loss.backward()
                optim.step()
                records.write(
                    json.dumps({"step": step, "rank": rank, "epoch": loader.epoch, "ids": ids.tolist()}) + "\n"
                )
                record_step(step)
                if step % EVERY == 0:
                    ckpt.save(step, state)
                for fault in faults:  # after save: one of them kills with an upload in flight
                    fault.maybe_fail(step, rank)
                if config.get("node_loss") and world == 2 and step == NODE_LOSS_STEP and rank == 1:
                    # Its upload of this step is held by the proxy; rank 0 waits in the
                    # next step's collective. The test pulls this node, which ends us.
                    publish_file(out / "trigger", ray.get_runtime_context().get_node_id())
                    # Ends only if the test could not pull the node: the run then goes on
                    # to its end instead of outliving the failed test in the background.
                    wait_for_file(out / "not-pulled", timeout_s=PULL_TIMEOUT_S, what="the test to pull this node")
                if step == config["steps"]:
                    break
    if rank == 0:
        module = model.module if hasattr(model, "module") else model
        torch.save(module.state_dict(), out / f"final-{config['steps']}.pt")


def _fit(config, workers, name, storage, on_trigger=None):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_goodput import GoodputCallback

    trainer = TorchTrainer(
        _loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1, "slot": 1}),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=5),
            callbacks=[GoodputCallback(tracking_uri=f"sqlite:///{storage}/mlflow.db")],
        ),
    )
    if on_trigger is None:
        return trainer.fit()
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=trainer.fit()), daemon=True)
    thread.start()
    trigger = wait_for_file(
        Path(config["out"]) / "trigger",
        timeout_s=PULL_TIMEOUT_S,
        what=f"rank 1 to reach step {NODE_LOSS_STEP} (or the run died: {box})",
    )
    try:
        on_trigger(trigger.read_text())
    except BaseException:
        publish_file(Path(config["out"]) / "not-pulled", "")
        thread.join(timeout=600)
        raise
    thread.join(timeout=600)
    assert not thread.is_alive(), "the run did not end within 600 s of the node loss"
    assert "result" in box
    return box["result"]


def _kept_records(out: Path) -> dict[int, dict]:
    """step -> {"epoch", "ids" (sorted, all ranks)}, from the last attempt that ran the step."""
    attempts: dict[str, list[Path]] = defaultdict(list)
    for path in out.glob("records-*.jsonl"):  # records-<attempt start>-<pid>-rank<r>.jsonl
        attempts[path.name.rsplit("-", 1)[0]].append(path)
    kept: dict[int, dict] = {}
    for tag in sorted(attempts, key=lambda t: float(t.split("-")[1])):  # a later attempt that
        attempt: dict[int, dict] = {}  # redid a step wins
        for path in attempts[tag]:
            for line in path.read_text().splitlines():
                r = json.loads(line)
                rec = attempt.setdefault(r["step"], {"epoch": r["epoch"], "ids": []})
                rec["ids"] = sorted(rec["ids"] + r["ids"])
        kept.update(attempt)
    return kept


def _reference_rank(rank: int, world: int, config: dict) -> None:
    _loop(config)


def _attempts(out: Path) -> list[dict]:
    paths = sorted(out.glob("attempt-*.json"), key=lambda p: float(p.name.split("-")[1]))
    return [json.loads(p.read_text()) for p in paths]


def _refresh_trains_view_without(node_id: str) -> None:
    """Once Ray knows ``node_id`` is dead, make Ray Train's elastic sizing see it too.

    Train sizes a restarted worker group from the nodes that Ray's autoscaling coordinator
    actor cached at its last refresh, which runs every 20 s: until then a restart asks
    for the dead node's worker too and waits out the worker-group start timeout, once or
    twice (30 s of this test's 70 s). The coordinator refreshes on demand when asked for
    a recomputed reservation; the restart then takes the one node left."""
    wait_for(
        lambda: not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()),
        timeout_s=60,
        what=f"Ray to mark removed node {node_id} dead",
    )
    coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    ray.get(coordinator.get_reserved_resources.remote("ray_goodput-tests", recompute=True), timeout=60)


def _run_with_failures(ray_cluster, s3_server, data: Path, out: Path, storage: str) -> str:
    """SIGKILL right after the save of step 12 (rank 0, its
    upload in flight); rank 1's node removed right after the save of step 20, with that
    step's uploads held by a proxy so they are in flight. Returns the checkpoint URI."""
    proxy = FlakyProxy(s3_server.endpoint)
    uri = s3_server.bucket_uri("faulty").replace(s3_server.endpoint, proxy.endpoint)
    # (A SIGKILL between saves is the LM example's fault; one restart fewer here.)
    faults = [dict(step=12, rank=0, marker_dir=str(out))]
    config = {"data": str(data), "out": str(out), "uri": uri, "steps": STEPS, "faults": faults, "node_loss": True}

    def pull(node_id: str) -> None:
        try:
            ray_cluster.remove(node_id)  # kills its worker and its uploader mid-upload
            _refresh_trains_view_without(node_id)
        finally:
            proxy.release()  # else a failed refresh would leave the run held for ever

    proxy.stall(f"/{step_dir(NODE_LOSS_STEP)}/", methods=("PUT", "POST"))
    try:
        _fit(config, (1, 2), "faulty", storage, on_trigger=pull)
    finally:
        proxy.close()
    # Read back directly: the proxy goes with the test.
    return uri.replace(proxy.endpoint, s3_server.endpoint)


@pytest.mark.timeout(1200)
def test_interrupted_run_equals_uninterrupted_run(tmp_path, s3_server, ray_cluster):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(SAMPLES):
        (data / f"{i:04d}.txt").write_text(str(i))
    # 1. With failures.
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    uri = _run_with_failures(ray_cluster, s3_server, data, faulty, str(tmp_path / "ray"))
    attempts = _attempts(faulty)
    assert [a["world"] for a in attempts] == [2, 2, 1], attempts
    assert attempts[0] == {"world": 2, "restored": None, "newest_committed": None, "newest_after_restore": None}
    for a in attempts:  # every resume took the newest committed checkpoint there was
        assert a["restored"] == a["newest_after_restore"], attempts
        assert (a["newest_committed"] or 0) <= (a["restored"] or 0), attempts
    resume_1 = attempts[-1]["restored"]  # resumed on fewer workers, resharded 2 -> 1
    assert 12 <= resume_1 < NODE_LOSS_STEP, attempts
    committed = [i for i in list_checkpoints(uri) if i.committed]
    assert committed[-1].step == STEPS - STEPS % EVERY and committed[-1].world_size == 1
    assert any(i.world_size == 2 for i in committed)
    # The save of step 20 in flight when its node went never committed (nor mixed with a
    # later save of step 20 at world size 1).
    assert not [i for i in committed if i.step == NODE_LOSS_STEP and i.world_size == 2], committed

    # 2. Reference without failures, same world sizes: 2 ranks to resume_1, then 1. The
    # same training function on plain processes (Ray Train's launch is not under test).
    ray_cluster.top_up()  # replaces the removed node for the tests after this one
    ref = tmp_path / "ref"
    ref.mkdir()
    base = {"data": str(data), "out": str(ref), "uri": s3_server.bucket_uri("ref"), "faults": []}
    run_world(_reference_rank, 2, {**base, "steps": resume_1}, timeout_s=300)
    run_world(_reference_rank, 1, {**base, "steps": STEPS}, timeout_s=300)

    got = torch.load(faulty / f"final-{STEPS}.pt")
    want = torch.load(ref / f"final-{STEPS}.pt")
    assert all(torch.equal(got[k], want[k]) for k in want), "weights differ"
    kept, reference = _kept_records(faulty), _kept_records(ref)
    assert sorted(kept) == list(range(1, STEPS + 1))
    assert kept == reference
    # No sample skipped or repeated: every finished epoch saw each sample exactly once.
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for step in range(1, STEPS + 1):
        by_epoch[kept[step]["epoch"]] += kept[step]["ids"]
    last = max(by_epoch)
    assert last >= 2  # the run spans several epochs, and resumed mid-epoch
    for epoch, ids in by_epoch.items():
        assert len(ids) == len(set(ids)), f"a sample repeated in epoch {epoch}"
        if epoch != last:
            assert sorted(ids) == list(range(SAMPLES)), f"samples skipped in epoch {epoch}"
    ledger = json.loads((tmp_path / "ray" / "faulty" / "goodput" / "summary.json").read_text())
    assert ledger["attempts"] == 3 and ledger["steps_kept"] == STEPS
    assert abs(sum(ledger["seconds"].values()) - ledger["total_s"]) <= 0.01 * ledger["total_s"]
