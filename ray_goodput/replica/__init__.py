"""Replica mode for data-parallel jobs: a failed replica is replaced while the others step on.

``ReplicaGroups`` is the driver's setting (``ray_goodput.TorchTrainer(fault_tolerance=...)``);
``Replica`` is the training function's side (model, optimizer, batches, the step, the
durable fallback). Built on torchft (``pip install "ray-goodput[ft]"``), imported only when
a ``Replica`` is made. The guide is ``docs/guide/replicas.md``.
"""

from ray_goodput._lazy import lazy_exports

_EXPORTS = {
    "ReplicaGroups": "ray_goodput.replica._config",
    "Replica": "ray_goodput.replica._replica",
    "ReplicaJoinError": "ray_goodput.replica._replica",
    "ReplicaStepError": "ray_goodput.replica._replica",
    "Position": "ray_goodput.replica._position",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
