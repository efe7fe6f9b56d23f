"""Driver side: what runs in the driver or the Ray Train controller — the TorchTrainer,
the Recovery controller callback and the goodput callback.

The public names load on first use (PEP 562): a node's health-check task imports
``ray_goodput.driver._health`` (this package first) in a fresh process on every node
before every attempt, and should not pay for Ray Train, torch and MLflow there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_goodput._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "GoodputCallback": "ray_goodput.driver._callback",
    "Recovery": "ray_goodput.driver._recovery",
    "load_state": "ray_goodput.driver._record",
    "TorchTrainer": "ray_goodput.driver._trainer",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from ray_goodput.driver._callback import GoodputCallback
    from ray_goodput.driver._record import load_state
    from ray_goodput.driver._recovery import Recovery
    from ray_goodput.driver._trainer import TorchTrainer
