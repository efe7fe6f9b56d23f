"""cluster.yaml: valid for `ray up`, and its commands do what they claim when run by bash.

The setup and start commands run through a real ``bash`` with the tools that would touch
the machine or the network (``ray``, ``mdadm``, ``mount``, ``mkfs.ext4``, ``pip``,
``apt-get``, ``sudo``, ``lsblk``...) replaced by stubs on PATH that record their arguments
and environment, one command per shell as the cluster launcher runs them.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO / "cluster.yaml"
STUBS = ("ray", "mdadm", "mount", "mountpoint", "mkfs.ext4", "pip", "apt-get", "sudo", "lsblk")
RECORDED_ENV = ("RAY_GOODPUT_STAGING_DIR", "RAY_GOODPUT_CACHE_DIR", "RAY_AUTH_MODE")


def _load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_is_valid_for_ray_up():
    config = prepare_config(_load())
    validate_config(config)  # what `ray up` runs before touching the cloud
    assert config["available_node_types"]["gpu_worker"]["min_workers"] >= 1


def test_validation_would_catch_a_broken_config():
    config = _load()
    config["max_workers"] = "many"
    with pytest.raises(Exception, match="many"):
        validate_config(prepare_config(config))


def _stub(bindir: Path, name: str, log: Path, lsblk_out: str) -> None:
    env_keys = " ".join(RECORDED_ENV)
    body = f"""#!/bin/bash
python3 - "$0" "$@" <<'PY'
import json, os, sys
rec = {{"cmd": os.path.basename(sys.argv[1]), "args": sys.argv[2:],
        "env": {{k: os.environ.get(k) for k in "{env_keys}".split()}}}}
open({str(log)!r}, "a").write(json.dumps(rec) + "\\n")
PY
"""
    if name == "lsblk":
        (bindir / "lsblk.out").write_text(lsblk_out)
        body += f"cat {bindir / 'lsblk.out'}\n"
    if name == "mountpoint":
        body += "exit 1\n"  # nothing mounted yet
    path = bindir / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run_node(tmp_path: Path, kind: str, lsblk_out: str) -> tuple[list[dict], Path, list[str]]:
    """Run every command a ``kind`` ("head"/"worker") node gets; return the stub records,
    the node's HOME and each command's stderr."""
    home, bindir, log = tmp_path / "home", tmp_path / "bin", tmp_path / "calls.jsonl"
    for d in (home, bindir):
        d.mkdir()
    for name in STUBS:
        _stub(bindir, name, log, lsblk_out)
    config = _load()
    for remote, local in config["file_mounts"].items():  # what `ray up` copies, from the checkout root
        target = home / remote.removeprefix("~/")
        target.parent.mkdir(parents=True, exist_ok=True)
        source = Path(os.path.expanduser(local)) if local.startswith("~") else REPO / local
        if source.exists():
            target.symlink_to(source.resolve())
    commands = (
        config["initialization_commands"]
        + config["setup_commands"]
        + config[f"{kind}_setup_commands"]
        + config[f"{kind}_start_ray_commands"]
    )
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(home), "RAY_HEAD_IP": "10.0.0.1"}
    errors = []
    for command in commands:
        done = subprocess.run(["bash", "-c", command], env=env, cwd=home, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{command!r} failed: {done.stderr}"
        errors.append(done.stderr)
    return [json.loads(line) for line in log.read_text().splitlines()], home, errors


def _ray_starts(calls: list[dict]) -> list[dict]:
    return [c for c in calls if c["cmd"] == "ray" and c["args"][:1] == ["start"]]


NVME = (
    "nvme0n1 Amazon Elastic Block Store\n"
    "nvme1n1 Amazon EC2 NVMe Instance Storage\n"
    "nvme2n1 Amazon EC2 NVMe Instance Storage\n"
)


@pytest.mark.parametrize("kind", ["head", "worker"])
def test_staging_and_cache_variables_reach_ray_start_on_the_nvme_raid(tmp_path, kind):
    calls, _, _ = _run_node(tmp_path, kind, NVME)
    (start,) = _ray_starts(calls)
    assert start["env"] == {
        "RAY_GOODPUT_STAGING_DIR": "/mnt/nvme/ray_goodput/staging",
        "RAY_GOODPUT_CACHE_DIR": "/mnt/nvme/ray_goodput/cache",
        "RAY_AUTH_MODE": "token",
    }
    sudo = [c["args"] for c in calls if c["cmd"] == "sudo"]
    assert [
        "mdadm",
        "--create",
        "/dev/md0",
        "--level=0",
        "--force",
        "--raid-devices=2",
        "/dev/nvme1n1",
        "/dev/nvme2n1",
    ] in sudo  # instance store only, not the EBS root
    assert ["mount", "-o", "noatime", "/dev/md0", "/mnt/nvme"] in sudo
    installs = [i for i, a in enumerate(sudo) if a[:1] == ["apt-get"]]
    assert sudo[installs[0]][1] == "update", "apt-get update must come before any install"


def test_node_without_instance_store_falls_back_to_root_disk_with_a_warning(tmp_path):
    calls, home, errors = _run_node(tmp_path, "worker", "nvme0n1 Amazon Elastic Block Store\n")
    (start,) = _ray_starts(calls)
    assert start["env"]["RAY_GOODPUT_STAGING_DIR"] == f"{home}/ray_goodput_local/staging"
    assert Path(start["env"]["RAY_GOODPUT_CACHE_DIR"]).is_dir()
    assert not any(c["args"][:1] in (["mdadm"], ["mkfs.ext4"]) for c in calls if c["cmd"] == "sudo")
    assert any("WARNING: no instance-store NVMe" in e for e in errors)


def test_ray_goodput_is_installed_from_the_checkout_that_file_mounts_copies(tmp_path):
    calls, home, _ = _run_node(tmp_path, "worker", NVME)
    targets = [a for c in calls if c["cmd"] == "pip" for a in c["args"] if a.startswith(str(home))]
    assert targets, "no pip install of a path on the node"
    (source,) = targets
    pyproject = Path(source) / "pyproject.toml"
    assert pyproject.is_file() and 'name = "ray-goodput"' in pyproject.read_text()


def test_dashboard_stays_on_localhost_and_token_auth_is_not_disabled(tmp_path):
    calls, _, _ = _run_node(tmp_path, "head", NVME)
    (start,) = _ray_starts(calls)
    assert "--head" in start["args"]
    assert not any(a.startswith("--dashboard-host") for a in start["args"])
    assert "disabled" not in CLUSTER_YAML.read_text().split("RAY_AUTH_MODE=")[1][:20]
    assert "~/.ray/auth_token" in _load()["file_mounts"]
