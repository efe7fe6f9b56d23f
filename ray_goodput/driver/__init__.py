"""Driver side: what runs in the driver or the Ray Train controller — the TorchTrainer,
the Recovery controller callback and the goodput callback."""

from ray_goodput.driver._callback import GoodputCallback
from ray_goodput.driver._recovery import Recovery, load_state
from ray_goodput.driver._trainer import TorchTrainer

__all__ = ["GoodputCallback", "Recovery", "TorchTrainer", "load_state"]
