"""Goodput accounting, worker side and pure: the step recorder, its event log, the ledger
and its text/chart/summary forms. The Ray Train callback that publishes it lives in
``ray_goodput.driver``."""

from ray_goodput.goodput._events import EventLog, EventReader, read_events
from ray_goodput.goodput._ledger import BUCKETS, Ledger, compute, fetch_stats
from ray_goodput.goodput._recorder import get_recorder, record_end, record_step
from ray_goodput.goodput._report import chart_png, summary, table
from ray_goodput.goodput._timeline import timeline_png

__all__ = [
    "BUCKETS",
    "EventLog",
    "EventReader",
    "Ledger",
    "chart_png",
    "compute",
    "fetch_stats",
    "get_recorder",
    "read_events",
    "record_end",
    "record_step",
    "summary",
    "table",
    "timeline_png",
]
