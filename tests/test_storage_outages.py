"""Storage that goes away for a while, and a second run on the same storage path, with real
storage: moto's S3 server behind a proxy that resets every connection during an outage, and
the Checkpointer's own upload code (the in-process uploader, which runs the same jobs as the
node's uploader actor), and one run through ``ray_goodput.TorchTrainer`` (the node's
uploader actor, the goodput events, ``ray-goodput status``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ray_goodput import Checkpointer, FencedError, RecoveryPointTooOldError, list_checkpoints
from ray_goodput.checkpoint import _checkpointer
from ray_goodput.checkpoint.protocol import _layout, _lineage
from ray_goodput.checkpoint.protocol._lineage import CLAIM_TIMEOUT_S
from ray_goodput.cli._status import checkpoint_lines
from ray_goodput.errors import StorageUnreachableError, not_retryable
from ray_goodput.goodput import compute, read_events
from ray_goodput.runtime import _resume
from ray_goodput.storage import RetryPolicy, resolve
from ray_goodput.testing import FlakyProxy

# A retry budget far below the outages here: what carries a save through is the outage
# retry, not the policy.
SHORT = RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1)


@pytest.fixture
def proxied(s3_server):
    proxy = FlakyProxy(s3_server.endpoint)
    uri = s3_server.bucket_uri("outage")  # created directly, not through the proxy
    yield uri.replace(s3_server.endpoint, proxy.endpoint), proxy
    proxy.close()


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))


def _committed(uri: str) -> list[int]:
    return [i.step for i in list_checkpoints(uri) if i.committed]


def _retrying_through_an_outage(ckpt: Checkpointer, proxy: FlakyProxy, model: torch.nn.Module, seconds: float) -> None:
    """Step 1 committed, then storage out for ``seconds`` and step 2's upload retrying
    through it (past the policy's budget)."""
    ckpt.save(1, {"model": model})
    ckpt.wait()
    proxy.outage(seconds)
    ckpt.save(2, {"model": model})
    deadline = time.monotonic() + 10.0
    while proxy.counts["failed"] <= SHORT.attempts and time.monotonic() < deadline:
        time.sleep(0.05)


def test_an_outage_past_the_retry_budget_is_retried_through_and_the_save_commits(proxied, tmp_path):
    uri, proxy = proxied
    model = _model()
    with Checkpointer(uri, staging_dir=str(tmp_path / "s"), retry=SHORT, uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
        ckpt.wait()
        proxy.outage(4.0)
        ckpt.save(2, {"model": model})
        ckpt.wait()  # returns once the outage is over and step 2 committed
        assert ckpt.stats.committed == [1, 2] and ckpt.stats.failed_saves == 0
    assert proxy.counts["failed"] > SHORT.attempts, proxy.counts  # the outage outlived many budgets
    assert _committed(uri) == [1, 2]


@pytest.fixture
def restart():
    """This process runs a restart of its run, as the driver's Recovery tells a worker."""
    _resume.set_decision(None, restart=True)
    yield
    _resume.set_decision(None)


def test_a_restarts_storage_probe_waits_through_an_outage_instead_of_ending_the_run(proxied, tmp_path, restart):
    # Every attempt's Checkpointer probes storage, and any failure was StorageUnusableError,
    # which a retry cannot fix: Recovery stopped the run. Storage down when a worker died
    # (or a restart after RecoveryPointTooOldError, made because storage was down) ended a
    # run that an outage must not end. A restart's probe now waits for it (within the
    # generation claim's wait for the probe).
    assert _checkpointer.RESTART_PROBE_WAIT_S < CLAIM_TIMEOUT_S
    uri, proxy = proxied
    model = _model()
    with Checkpointer(uri, staging_dir=str(tmp_path / "s"), retry=SHORT, uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
        ckpt.wait()
    proxy.outage(3.0)
    start = time.monotonic()
    with Checkpointer(uri, staging_dir=str(tmp_path / "s2"), retry=SHORT, uploader="thread") as ckpt:
        assert time.monotonic() - start >= 2.0  # it waited for storage to come back
        fresh = _model()
        assert ckpt.restore({"model": fresh}) == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_storage_down_at_a_first_start_fails_at_once_and_a_restarts_wait_ends_at_its_bound(
    proxied, tmp_path, monkeypatch
):
    uri, proxy = proxied
    proxy.outage(60.0)
    start = time.monotonic()
    with pytest.raises(StorageUnreachableError, match="not usable") as first:
        Checkpointer(uri, staging_dir=str(tmp_path / "s"), retry=SHORT, uploader="thread")
    assert time.monotonic() - start < 15.0  # a first start does not wait for it: a wrong endpoint looks the same
    assert not_retryable(first.value) is first.value  # Recovery stops the run
    monkeypatch.setattr(_checkpointer, "RESTART_PROBE_WAIT_S", 2.0)
    _resume.set_decision(None, restart=True)
    try:
        start = time.monotonic()
        with pytest.raises(StorageUnreachableError, match=r"probed for 2 s") as again:
            Checkpointer(uri, staging_dir=str(tmp_path / "s"), retry=SHORT, uploader="thread")
        assert 2.0 <= time.monotonic() - start < 20.0
    finally:
        _resume.set_decision(None)
    assert not_retryable(again.value) is again.value  # past its wait a restart's is not retried either


def test_a_commits_deletes_are_retried_as_its_other_requests_are(proxied, tmp_path):
    # Every commit deletes the step's QUARANTINED record (and, replacing an older
    # generation's commit, its COMMITTED) with one bare request, retried only by the S3
    # client (~0.4 s): a burst of 503s on it failed the save, where every other request of
    # the commit is retried by the policy (and a restore finishing an orphan the same way).
    uri, proxy = proxied
    policy = RetryPolicy(attempts=4, initial_delay=0.05, max_delay=0.1)
    with Checkpointer(uri, staging_dir=str(tmp_path / "s"), retry=policy, uploader="thread") as ckpt:
        proxy.fail_next("QUARANTINED", times=6)  # more than the S3 client's own 4 tries
        ckpt.save(1, {"model": _model()})
        ckpt.wait()
        assert ckpt.stats.committed == [1] and ckpt.stats.failed_saves == 0, ckpt.stats
    asked = sum(n for (_, path), n in proxy.requests.items() if "QUARANTINED" in path)
    assert asked > 6, proxy.requests  # the six refusals, then the delete went through
    assert _committed(uri) == [1]


def test_a_save_retrying_through_an_outage_gives_way_to_a_newer_save(proxied, tmp_path):
    uri, proxy = proxied
    model = _model()
    with Checkpointer(uri, staging_dir=str(tmp_path / "s"), retry=SHORT, uploader="thread") as ckpt:
        _retrying_through_an_outage(ckpt, proxy, model, 4.0)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ckpt.save(3, {"model": model})  # waits behind step 2: step 2 gives way to it
        ckpt.wait()
        assert ckpt.stats.superseded == [2] and ckpt.stats.committed == [1, 3], ckpt.stats
        assert ckpt.stats.failed_saves == 0
    assert _committed(uri) == [1, 3]
    fresh = _model()
    with Checkpointer(uri, staging_dir=str(tmp_path / "r"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh}) == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_leaving_the_with_block_on_an_error_during_an_outage_does_not_wait_out_the_saves_retries(proxied, tmp_path):
    """The in-process (thread) uploader's close waited for its lane's running job, which
    retries an outage for its whole budget (600 s at least): leaving ``with Checkpointer``
    on an error, meant to release and re-raise, blocked for that long. The job retrying
    the outage now gives up at its next round once the Checkpointer closes."""
    uri, proxy = proxied
    model, left = _model(), []

    def train() -> None:
        try:
            with Checkpointer(uri, staging_dir=str(tmp_path / "s"), retry=SHORT, uploader="thread") as ckpt:
                _retrying_through_an_outage(ckpt, proxy, model, 600.0)
                raise RuntimeError("the training loop failed")
        except RuntimeError:
            left.append(time.monotonic())

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    worker.join(60)
    proxy.outage(0.0)
    assert not worker.is_alive() and left, "leaving the with block waited for the save's outage retries"
    assert _committed(uri) == [1]


def test_leaving_the_with_block_on_an_error_with_storage_up_still_commits_the_waiting_save(proxied, tmp_path):
    """Stopping the lanes at close dropped the waiting save too: an unrelated error in the
    loop (a NaN, a data error) threw away the newest save, which would have committed
    seconds later, and the restart resumed from an older step."""
    uri, proxy = proxied
    model = _model()
    proxy.latency_s = 0.2  # uploads take a while: step 2 waits behind step 1
    with pytest.raises(RuntimeError), Checkpointer(uri, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
        ckpt.save(2, {"model": model})
        raise RuntimeError("the training loop failed")
    proxy.latency_s = 0.0
    assert _committed(uri) == [1, 2]


def test_an_outage_longer_than_the_recovery_point_bound_raises_naming_age_storage_and_error(proxied, tmp_path):
    uri, proxy = proxied
    model = _model()
    ckpt = Checkpointer(
        uri, staging_dir=str(tmp_path / "s"), retry=SHORT, uploader="thread", max_recovery_point_age_s=1.5
    )
    try:
        ckpt.save(1, {"model": model})
        ckpt.wait()
        proxy.outage(60.0)
        ckpt.save(2, {"model": model})
        with pytest.raises(RecoveryPointTooOldError) as err:
            ckpt.wait()  # step 2 retries for the bound, then fails; step 1 is too old by then
        text = str(err.value)
        age = float(re.search(r"\(committed step 1\) is (\d+\.\d) s old, over the bound of 1\.5 s", text).group(1))
        assert age > 1.5 and uri in text and "step 2" in text, text
    finally:
        proxy.outage(0.0)
        ckpt._release()
    assert _committed(uri) == [1]  # what was committed is kept


_SECOND_RUN = """
import sys, os, torch
from ray_goodput import Checkpointer
root, staging = sys.argv[1], sys.argv[2]
with Checkpointer(root, staging_dir=staging, uploader="thread", keep_last=10) as ckpt:
    ckpt.save(5, {"model": torch.nn.Linear(8, 8)})
print(ckpt.generation, os.getpid())
"""


def _first_run(tmp_path: Path) -> tuple[str, torch.nn.Module, Checkpointer]:
    """The run on ``<tmp_path>/shared`` that another run fences: its storage path, its model,
    and its Checkpointer (open, step 1 committed; the caller releases it)."""
    root = str(tmp_path / "shared")
    model = _model()
    # keep_last covers every save here: retention (the newer run's, by lineage) is not the point
    first = Checkpointer(root, staging_dir=str(tmp_path / "a"), uploader="thread", keep_last=10)
    try:
        first.save(1, {"model": model})
        first.wait()
    except BaseException:
        first._release()
        raise
    return root, model, first


def _second_run(root: str, staging: str) -> tuple[str, str]:
    """Another run, in its own process, saves step 5 on ``root``: ``(generation, pid)``."""
    done = subprocess.run(
        [sys.executable, "-c", _SECOND_RUN, root, staging], capture_output=True, text=True, timeout=120, check=True
    )
    generation, pid = done.stdout.split()[-2:]
    return generation, pid


def _fenced_save(first: Checkpointer, step: int, model: torch.nn.Module) -> str:
    """``first`` saves ``step``: its wait must raise FencedError; returns its text."""
    first.save(step, {"model": model})
    with pytest.raises(FencedError) as err:
        first.wait()
    assert not_retryable(err.value) is err.value  # a retry would fence the other run in turn
    return str(err.value)


def test_a_second_run_that_saves_on_the_storage_path_fences_the_first_with_a_typed_error(tmp_path):
    root, model, first = _first_run(tmp_path)
    try:
        with Checkpointer(root, staging_dir=str(tmp_path / "e"), uploader="thread") as evaluator:
            assert evaluator.restore({"model": _model()}) == 1  # claims, never saves: fences nobody
        first.save(2, {"model": model})
        first.wait()
        generation, pid = _second_run(root, str(tmp_path / "b"))
        text = _fenced_save(first, 3, model)
        assert f"generation {generation} claimed by pid {pid} on host {socket.gethostname()}" in text, text
        assert f"this run's generation {first.generation}" in text and "own storage_path" in text
    finally:
        first._release()
    assert _committed(root) == [1, 2, 3, 5]  # neither run's commits were touched


def test_a_restore_only_claim_above_a_newer_saving_run_does_not_hide_it_from_the_fence(tmp_path):
    """The fence read the newest claim only: an evaluation copy opened after a second run
    had taken the storage path claimed a generation above it and never saved, so the first
    run's saves no longer saw the second run, and both saved on the same path. Once the
    fence is known, an owner record that cannot be read must not undo it either."""
    root, model, first = _first_run(tmp_path)
    try:
        generation, pid = _second_run(root, str(tmp_path / "b"))
        with Checkpointer(root, staging_dir=str(tmp_path / "e"), uploader="thread") as evaluator:
            assert evaluator.restore({"model": torch.nn.Linear(8, 8)}) == 5  # the second run's model
        assert _lineage.claimed_generation(resolve(root)) > int(generation)  # the evaluator's claim is the newest
        text = _fenced_save(first, 3, model)
        assert f"generation {generation} claimed by pid {pid} on host {socket.gethostname()}" in text, text
        (record,) = [
            p for p in Path(root, "checkpoints").iterdir() if (_layout.claim_of(p.name) or (0,))[0] == int(generation)
        ]
        record.unlink()
        record.mkdir()  # unreadable as a file
        text = _fenced_save(first, 4, model)
        assert f"generation {generation} claimed by an owner not on record" in text, text
    finally:
        first._release()
    assert _committed(root) == [1, 3, 4, 5]


OUTAGE_S = 6.0
SYNC_EVERY = 8  # Checkpointer's default: saves between outcome agreements
STEPS, SIGNAL_AT, STEP_S = 200, 10, 0.05  # the outage starts at step 10 and ends well before the last


def _outage_loop(config: dict) -> None:
    """Saves every 2 steps; tells the driver to take storage down at SIGNAL_AT."""
    model = torch.nn.Linear(64, 64)
    retry = RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1)
    with Checkpointer(config["uri"], retry=retry) as ckpt:
        for step in range(1, STEPS + 1):
            time.sleep(STEP_S)
            with torch.no_grad():
                model.weight.add_(0.01)
            if step == SIGNAL_AT:
                ckpt.wait()  # a durable checkpoint first, whose age the outage then grows
                Path(config["signal"]).write_text("down")
            if step % 2 == 0:
                ckpt.save(step, {"model": model})
    stats = ckpt.stats
    out = {"committed": stats.committed, "superseded": stats.superseded, "failed": stats.failed_saves}
    Path(config["out"]).write_text(json.dumps({**out, "pid": os.getpid()}))


@pytest.mark.slow
def test_a_storage_outage_shorter_than_the_bound_costs_a_ray_train_run_no_restart_and_no_step(
    ray_local, proxied, tmp_path
):
    """The run the issue saw fail (a 12 s outage past the retry budget, then close() raised
    for a save that a newer commit had left behind): through Ray Train and the node's
    uploader actor it completes in one attempt, its newest step committed."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    import ray_goodput

    uri, proxy = proxied
    signal, out = tmp_path / "signal", tmp_path / "out.json"

    def take_down() -> None:
        deadline = time.monotonic() + 120
        while not signal.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proxy.outage(OUTAGE_S)

    threading.Thread(target=take_down, daemon=True).start()
    reports = tmp_path / "reports.jsonl"
    trainer = ray_goodput.TorchTrainer(
        _outage_loop,
        train_loop_config={"uri": uri, "signal": str(signal), "out": str(out)},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(
            storage_path=str(tmp_path / "runs"),
            name="outage",
            failure_config=FailureConfig(max_failures=0),
            callbacks=[_report_log(reports)],
        ),
    )
    trainer.fit()  # raises if the run failed
    res = json.loads(out.read_text())
    assert signal.exists() and proxy.counts["failed"] > 10, proxy.counts  # storage really went down
    assert res["committed"][-1] == STEPS and _committed(uri)[-1] == STEPS, res
    assert res["superseded"], res  # saves during the outage gave way to newer ones
    run_dir = str(tmp_path / "runs" / "outage")
    ledger = compute(list(read_events(resolve(run_dir)).values()))
    assert ledger.attempts == 1 and ledger.finished  # no restart
    assert ledger.recovery_point_age_max_s is not None and ledger.recovery_point_age_max_s > OUTAGE_S / 2, ledger
    assert ledger.recovery_point_age_s is not None and ledger.recovery_point_age_s < OUTAGE_S / 2, ledger
    (line,) = checkpoint_lines(run_dir)
    assert f"superseded {ledger.checkpoints_superseded}" in line and "s old at the run's end" in line, line
    # close() reported the last commit and no more: a report is a barrier of every worker,
    # and a second one at the end only held up the run's end.
    logged = [json.loads(line) for line in reports.read_text().splitlines()]
    assert logged[-1] == {"step": STEPS, "checkpoint": True}, logged[-1]
    # One report per outcome agreement (every sync_every-th save, and close), carrying the
    # newest commit: Ray's controller takes one report per poll (2 s by default), and a
    # report made while the previous one waits holds the training loop until that poll.
    agreements = (STEPS // 2) // SYNC_EVERY + 1
    assert len(logged) <= agreements, [e["step"] for e in logged]
    assert [e["step"] for e in logged] == sorted({e["step"] for e in logged}), logged


def _report_log(path: Path):
    """A Ray Train callback (run in the controller) that logs each report's step and
    whether it carried a checkpoint."""
    import ray.train

    class ReportLog(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint) -> None:
            with open(path, "a") as f:
                f.write(json.dumps({"step": metrics[0].get("step"), "checkpoint": checkpoint is not None}) + "\n")

    return ReportLog()
