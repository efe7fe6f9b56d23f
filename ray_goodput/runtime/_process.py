"""Process liveness: the one test of whether a local process still runs.

Node services outlive the workers that use them; they find out a worker died by its pid
(a killed process cleans up nothing, so its files must be removed by someone else).
"""

from __future__ import annotations

import os

import psutil


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this machine still runs (True when it is not ours to
    signal). A zombie (killed, not yet reaped by its parent) does not: it runs no code."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists; whether it runs is asked below
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # exists, but its state cannot be read: take it for running
        return True
