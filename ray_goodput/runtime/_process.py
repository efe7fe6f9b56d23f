"""Process liveness: the one test of whether a local process still runs.

Node services outlive the workers that use them; they find out a worker died by its pid
(a killed process cleans up nothing, so its files must be removed by someone else).
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this machine still exists (True when it is not ours to signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
