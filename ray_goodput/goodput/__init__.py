"""Goodput accounting: worker-side recording, the ledger, and the Ray Train callback."""

from ray_goodput.goodput._callback import GoodputCallback
from ray_goodput.goodput._ledger import BUCKETS, Ledger, compute
from ray_goodput.goodput._recorder import get_recorder, record_end, record_step

__all__ = ["BUCKETS", "GoodputCallback", "Ledger", "compute", "get_recorder", "record_end", "record_step"]
