"""The ray-goodput CLI (ls, verify) against real storage: in-process through ``main``,
and once as a real subprocess (entry point, output and exit status; each start costs
seconds of imports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from ray_goodput import Checkpointer
from ray_goodput.cli import main


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray_goodput.cli", *args], capture_output=True, text=True, timeout=120)


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _saved(tmp_path, steps: tuple[int, ...], size: int = 8) -> str:
    """A storage root under ``tmp_path`` with a committed checkpoint of a Linear(size, size)
    at each of ``steps``; returns the root."""
    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), keep_last=5) as ckpt:
        for step in steps:
            ckpt.save(step, {"model": torch.nn.Linear(size, size)})
            ckpt.wait()
    return root


def test_ls_and_verify(tmp_path, capsys):
    root = _saved(tmp_path, (5, 10), size=64)
    leftover = tmp_path / "root/checkpoints/step-000000015"  # a rank killed mid-save
    leftover.mkdir()
    (leftover / "__0_g000009-deadbeef.distcp").write_bytes(b"half a shard")
    (tmp_path / "root/checkpoints/step-000000020").mkdir()  # emptied by retention: not listed
    code, out, err = _run(capsys, "ls", root)
    assert code == 0, err
    lines = out.splitlines()
    assert "STEP" in lines[0]
    assert [ln.split()[:2] for ln in lines[1:]] == [["5", "committed"], ["10", "committed"], ["15", "uncommitted"]]
    code, out, _ = _run(capsys, "verify", root)
    assert code == 0 and "step 10: ok" in out, out
    (shard,) = (tmp_path / "root/checkpoints/step-000000010").glob("__0_*.distcp")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = _cli("verify", root, "--step", "10")  # the real command: output and exit status
    assert bad.returncode == 1 and "checksum mismatch" in bad.stdout, bad.stdout + bad.stderr
    assert _run(capsys, "verify", root, "--step", "5")[0] == 0
    assert _run(capsys, "verify", root, "--step", "99")[0] == 2


def test_verify_goes_on_past_a_step_it_cannot_check_and_quarantines_nothing_for_it(tmp_path, capsys):
    """A storage error while checking one step (here a manifest naming a checksum this
    version does not know: a newer writer's) ended the command with a traceback-like error
    and exit 2, and the steps after it were never checked. The step is reported as not
    checked (and not quarantined: storage failing says nothing of the checkpoint), the
    others are checked, and the exit status says it (2, or 1 when one is damaged)."""
    import json

    root = _saved(tmp_path, (5, 10, 15))
    commit = tmp_path / "root/checkpoints/step-000000010/COMMITTED"
    record = json.loads(commit.read_text())
    commit.write_text(json.dumps({**record, "files": [{**f, "checksum": "md5"} for f in record["files"]]}))
    code, out, _ = _run(capsys, "verify", root)
    assert code == 2, out
    assert "step 5: ok" in out and "step 10: could not be checked" in out and "step 15: ok" in out, out
    assert not (commit.parent / "QUARANTINED").exists()
    (shard,) = (tmp_path / "root/checkpoints/step-000000015").glob("__0_*.distcp")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "verify", root)
    assert code == 1 and "step 15: DAMAGED (quarantined)" in out, out


def test_bad_uri_is_a_clear_error(capsys):
    code, _, err = _run(capsys, "ls", "nosuchscheme://x")
    assert code == 2 and "cannot resolve storage URI" in err


def test_verify_of_a_step_whose_commit_vanishes_meanwhile_neither_calls_it_damaged_nor_condemns_it(
    tmp_path, capsys, monkeypatch
):
    """Retention removed a step (or a newer generation was re-committing it) between the
    listing and the manifest's read: verify called it DAMAGED, exited 1, and wrote a
    QUARANTINED record with no digest, which condemns every later commit of that step, so
    a fresh commit made meanwhile was skipped by restores and deleted by retention."""
    from ray_goodput.cli import _checkpoints

    root = _saved(tmp_path, (5, 10))
    read = _checkpoints.read_manifest
    monkeypatch.setattr(_checkpoints, "read_manifest", lambda loc: None if loc.uri.endswith("010") else read(loc))
    code, out, _ = _run(capsys, "verify", root)
    assert code == 0 and "step 5: ok" in out and "step 10: removed while verify ran" in out, out
    assert not (tmp_path / "root/checkpoints/step-000000010/QUARANTINED").exists()


def test_verify_of_a_step_removed_while_its_files_were_checked_does_not_quarantine_it(tmp_path, capsys, monkeypatch):
    """The likelier race: checksumming takes long, and retention (or a new generation's
    commit of the step) removes or rewrites its files after the manifest was read; verify
    found them missing, exited 1 and wrote QUARANTINED into a directory being deleted or
    recommitted. The commit is read again before anything is called damaged."""
    import shutil

    from ray_goodput.cli import _checkpoints

    root = _saved(tmp_path, (5, 10))
    check = _checkpoints.verify
    step_dir = tmp_path / "root/checkpoints/step-000000010"

    def retention_meanwhile(loc, manifest, **kwargs):
        if loc.uri.endswith("010"):
            shutil.rmtree(step_dir)  # retention deletes the step while its files are checked
        return check(loc, manifest, **kwargs)

    monkeypatch.setattr(_checkpoints, "verify", retention_meanwhile)
    code, out, _ = _run(capsys, "verify", root)
    assert code == 0 and "step 5: ok" in out and "step 10: removed while verify ran" in out, out
    assert not step_dir.exists()  # no QUARANTINED record recreated it


def test_ls_loads_neither_torch_nor_ray(tmp_path):
    """The docs promise it (a listing should not wait seconds for imports); the module that
    holds ``ls`` imported torch and DCP for ``export``."""
    script = (
        "import sys\n"
        "from ray_goodput.cli import main\n"
        f"assert main(['ls', {str(tmp_path)!r}]) == 0\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_export_to_a_directory_or_a_full_disk_is_a_clear_error_and_leaves_no_temp_file(tmp_path, capsys):
    """``export ROOT existing_dir/`` failed in the final rename with a traceback and left a
    temp file the size of the whole model beside it; a full disk left a partial one (and
    torch's own file writer raised its ENOSPC as a RuntimeError, past the CLI's errors)."""
    import os

    from tests._helpers import unshare_or_skip

    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s")) as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(256, 256)})  # 257 KiB: more than the small disk below
        ckpt.wait()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = _run(capsys, "export", root, str(out_dir))
    assert code == 2 and "is a directory" in err and "model.pt" in err, err
    assert list(out_dir.iterdir()) == [] and not list(tmp_path.glob(".out.tmp-*"))
    assert _run(capsys, "export", root, str(out_dir / "model.pt"))[0] == 0
    # A real full disk: a 64 KiB tmpfs, mounted in a user namespace of its own.
    unshare = unshare_or_skip("the full-disk half")
    small = tmp_path / "small"
    small.mkdir()
    command = (
        f"mount -t tmpfs -o size=64k none {small} && {sys.executable} -m ray_goodput.cli export {root} "
        f"{small}/model.pt; echo exit=$?; ls -A {small}"
    )
    done = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert done.stdout.split() == ["exit=2"], (done.stdout, done.stderr[-2000:])  # and nothing left in it
    assert "could not write" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_status_without_a_cluster_says_so_instead_of_a_traceback(capsys, monkeypatch):
    """ray.init raised its ConnectionError out of the command as a traceback. Ray connects
    "auto" to any Ray it finds running on the machine (the suite's own, here), so its
    failure is what a machine with no cluster gives: Ray's own error type and message."""
    from ray_goodput.cli import _status

    def no_cluster(*args, **kwargs):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    monkeypatch.setattr(_status.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(_status.ray, "init", no_cluster)
    code, _, err = _run(capsys, "status")
    assert code == 2 and "no Ray cluster at 'auto'" in err and "--address" in err, err


def test_report_finds_a_run_whose_name_has_a_quote(tmp_path, capsys):
    """The name went into MLflow's filter unescaped: a quote in it raised a parse error."""
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("ray_goodput")
    run = client.create_run(exp, run_name="it's")
    client.log_metric(run.info.run_id, "goodput/goodput", 0.5)
    client.log_metric(run.info.run_id, "goodput/total_s", 10.0)
    client.set_terminated(run.info.run_id)
    code, out, err = _run(capsys, "report", "it's", "--tracking-uri", uri)
    assert code == 0 and "goodput 50.0%" in out, out + err
