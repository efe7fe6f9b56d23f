"""Test utilities: real multi-process gloo worlds, real process-killing fault injection,
a faulty HTTP proxy and bounded waits.

Shipped with the library so users can test their own training loops the same way.
"""

from ray_goodput.testing._faults import FailAt, kill_self
from ray_goodput.testing._flaky_proxy import FlakyProxy
from ray_goodput.testing._net import free_port
from ray_goodput.testing._wait import publish_file, wait_for, wait_for_file
from ray_goodput.testing._world import run_world

__all__ = ["FailAt", "FlakyProxy", "free_port", "kill_self", "publish_file", "run_world", "wait_for", "wait_for_file"]
