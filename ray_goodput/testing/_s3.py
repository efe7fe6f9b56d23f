"""moto's S3 server in a subprocess on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

from ray_goodput.testing._net import free_port


def start_moto_server(timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start it; returns the process and its ``host:port`` endpoint once it answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc, f"127.0.0.1:{port}"
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")
