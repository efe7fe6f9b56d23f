"""The ray-goodput CLI (ls, verify) as a real subprocess against real storage."""

from __future__ import annotations

import subprocess
import sys

import torch

from ray_goodput import Checkpointer


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray_goodput.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_ls_and_verify(tmp_path):
    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), keep_last=5) as ckpt:
        for step in (5, 10):
            ckpt.save(step, {"model": torch.nn.Linear(64, 64)})
            ckpt.wait()
    (tmp_path / "root/checkpoints/step-000000015").mkdir()  # an uncommitted leftover
    out = _cli("ls", root)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "STEP" in lines[0]
    assert [ln.split()[:2] for ln in lines[1:]] == [["5", "committed"], ["10", "committed"],
                                                    ["15", "uncommitted"]]
    ok = _cli("verify", root)
    assert ok.returncode == 0 and "step 10: ok" in ok.stdout, ok.stdout
    (shard,) = (tmp_path / "root/checkpoints/step-000000010").glob("__0_*.distcp")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = _cli("verify", root, "--step", "10")
    assert bad.returncode == 1 and "checksum mismatch" in bad.stdout
    assert _cli("verify", root, "--step", "5").returncode == 0
    assert _cli("verify", root, "--step", "99").returncode == 2


def test_bad_uri_is_a_clear_error():
    out = _cli("ls", "nosuchscheme://x")
    assert out.returncode == 2 and "cannot resolve storage URI" in out.stderr
