"""moto's S3 server in a subprocess on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import psutil

from ray_goodput.testing._net import free_port

_ATTEMPTS = 3


def start_moto_server(timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start it; returns the process and its ``host:port`` endpoint once it answers.

    The port is picked free and bound by moto a moment later: another process can take it
    in between (two servers starting at once, as the CI soak's and the test session's
    do). An answer counts only once this process is the one listening there; else it is
    started again on another port."""
    for _ in range(_ATTEMPTS):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if _wait_until_serving(proc, port, timeout_s):
            return proc, f"127.0.0.1:{port}"
        proc.kill()
        proc.wait()
    raise RuntimeError(f"moto server did not start on a free port in {_ATTEMPTS} attempts of {timeout_s} s")


def _wait_until_serving(proc: subprocess.Popen, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
            continue
        if _listens(proc.pid, port):
            return True
        time.sleep(0.2)  # someone else answers there; ours exits once its bind fails
    return False


def _listens(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)
