"""Ray-level runtime helpers shared by every component: who am I (:class:`WorkerContext`),
node services (naming, lookup, pinning, shutdown of per-node actors: ``_services``) and
process liveness."""

from ray_goodput.runtime._context import WorkerContext, ray_initialized, run_root, world_of_one
from ray_goodput.runtime._process import pid_alive
from ray_goodput.runtime._services import shutdown

__all__ = ["WorkerContext", "pid_alive", "ray_initialized", "run_root", "shutdown", "world_of_one"]
