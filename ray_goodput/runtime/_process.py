"""Process liveness: the one test of whether a local process still runs.

Node services outlive the workers that use them; they find out a worker died by its pid
(a killed process cleans up nothing, so its files must be removed by someone else).
"""

from __future__ import annotations

import os

import psutil

_START_SLACK_S = 60.0


def pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process ``pid`` on this machine still runs (True when it is not ours to
    signal). A zombie (killed, not yet reaped by its parent) does not: it runs no code.

    ``since``: a time (``time.time()``) when the process asked about ran, such as the
    modification time of a file it wrote. A process under ``pid`` that started more than a
    minute after it is a later one, given the pid of a process since dead: False."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists; whether it runs is asked below
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        # Started after ``since``: not the process that ran then. The slack covers the
        # start time's reading (from the boot time, which a step of the wall clock moves);
        # a pid comes round again far later than that.
        return since is None or process.create_time() <= since + _START_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # exists, but its state cannot be read: take it for running
        return True
