"""Driver side: what runs in the driver or the Ray Train controller (the goodput callback)."""

from ray_goodput.driver._callback import GoodputCallback

__all__ = ["GoodputCallback"]
