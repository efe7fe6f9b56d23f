"""The job as a timeline: one row per attempt, time across, each span in its ledger bucket.

Pure span computation (:func:`spans`, :func:`marks`) plus a PNG renderer. A step event
says how long the step waited for its quorum (replica mode), for data and for a checkpoint
save, not when inside the step; the timeline draws the waits first, then the compute, then
the checkpoint stall.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray_goodput.goodput._ledger import BUCKETS, keep_limits, kept_upto

COLORS = dict(
    zip(BUCKETS, ["#2ca02c", "#98df8a", "#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"])
)


@dataclass(frozen=True)
class Span:
    """``[start, end]`` (wall-clock seconds) of attempt ``row`` spent in ``bucket``."""

    row: int
    start: float
    end: float
    bucket: str


@dataclass(frozen=True)
class Mark:
    """A point event on attempt ``row``: ``kind`` is failure, save, resume, note, or (replica
    mode) replica_lost / replica_back."""

    row: int
    t: float
    kind: str
    label: str


def _step_spans(row: int, e: dict[str, Any], kept: bool, first: bool) -> list[Span]:
    """A step's window: its quorum wait (replica mode; start-up in the job's ``first``
    step), its data wait, its compute, its checkpoint stall."""
    fetch, ckpt, wait = e.get("fetch", 0.0), e.get("ckpt", 0.0), e.get("wait", 0.0)
    start = e["t0"] + wait + fetch
    work_end = max(start, e["t"] - ckpt)
    if kept:  # with fewer replicas than configured, the missing share is degraded (the ledger's)
        split = start + (work_end - start) * min(1.0, e.get("capacity", 1.0))
        work = [Span(row, start, split, "productive"), Span(row, split, work_end, "degraded")]
    else:
        work = [Span(row, start, work_end, "lost")]
    return [
        Span(row, e["t0"], e["t0"] + wait, "startup" if first else "restart_downtime"),
        Span(row, e["t0"] + wait, start, "data_stall"),
        *work,
        Span(row, work_end, e["t"], "checkpoint_stall"),
    ]


def spans(attempts: list[list[dict[str, Any]]], job_start: float | None = None) -> list[Span]:
    """Every span of every attempt (each attempt's events sorted by time), zero-length
    spans dropped."""
    out: list[Span] = []
    prev_end = job_start if job_start is not None else (attempts[0][0]["t"] if attempts else 0.0)
    for row, events in enumerate(attempts):
        keep_upto = kept_upto(attempts, row)  # as the ledger keeps them
        first = next((e["t0"] for e in events if e["e"] in ("step", "uncommitted", "restore")), events[-1]["t"])
        out.append(Span(row, prev_end, first, "startup" if row == 0 else "restart_downtime"))
        stepped = False
        for e, limit in zip(events, keep_limits(events, keep_upto)):
            if e["e"] == "restore":
                out.append(Span(row, e["t0"], e["t"], "restore"))
            elif e["e"] == "uncommitted":  # replica mode: a try of a step that was retried
                out.append(Span(row, e["t0"], e["t"], "lost"))
            elif e["e"] == "step":
                out += _step_spans(row, e, limit is None or e["step"] <= limit, row == 0 and not stepped)
                stepped = True
        prev_end = events[-1]["t"]
    return [s for s in out if s.end > s.start]


def marks(attempts: list[list[dict[str, Any]]], notes: dict[int, str] | None = None) -> list[Mark]:
    """Failures (end of every attempt but the last), saves, resumes, replica mode's
    replacements (the first step with fewer replicas, the first with all of them again), and
    ``notes`` (text at the start of an attempt, e.g. the nodes excluded from it)."""
    out: list[Mark] = []
    for row, events in enumerate(attempts):
        out += _replica_marks(row, events)
        out += [Mark(row, e["t"], "save", "") for e in events if e["e"] == "step" and e.get("ckpt", 0.0) > 0]
        out += [
            Mark(row, e["t"], "resume", f"resumed from step {e.get('step') or 0}")
            for e in events
            if e["e"] == "restore"
        ]
        if row + 1 < len(attempts):
            out.append(Mark(row, events[-1]["t"], "failure", "failure"))
        if notes and notes.get(row):
            out.append(Mark(row, events[0]["t"], "note", notes[row]))
    return out


def _replica_marks(row: int, events: list[dict[str, Any]]) -> list[Mark]:
    out, prev = [], 1.0
    for e in events:
        if e["e"] != "step":
            continue
        cap = e.get("capacity", 1.0)
        if cap < prev:
            out.append(Mark(row, e["t0"], "replica_lost", f"replica lost ({cap:.0%} stepping)"))
        elif cap > prev and cap >= 1.0:
            out.append(Mark(row, e["t0"], "replica_back", "replacement healed"))
        prev = cap
    return out


def timeline_png(
    attempts: list[list[dict[str, Any]]],
    path: str,
    *,
    job_start: float | None = None,
    notes: dict[int, str] | None = None,
) -> None:
    """Render the timeline of ``attempts`` to ``path`` (PNG)."""
    import matplotlib  # noqa: PLC0415 - optional plotting dependency, loaded only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is chosen

    all_spans = spans(attempts, job_start)
    t0 = min((s.start for s in all_spans), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * max(1, len(attempts))))
    for s in all_spans:
        ax.barh(s.row, s.end - s.start, left=s.start - t0, color=COLORS[s.bucket], height=0.6)
    symbols = {
        "failure": ("x", "#d62728"),
        "save": ("|", "black"),
        "resume": ("^", "#1f77b4"),
        "note": ("*", "#9467bd"),
        "replica_lost": ("v", "#d62728"),
        "replica_back": ("^", "#2ca02c"),
    }
    for m in marks(attempts, notes):
        symbol, color = symbols[m.kind]
        ax.plot(m.t - t0, m.row + 0.4, marker=symbol, color=color, markersize=7, linestyle="none")
        if m.label and m.kind != "save":
            ax.annotate(m.label, (m.t - t0, m.row + 0.4), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yticks(range(len(attempts)), [f"attempt {i + 1}" for i in range(len(attempts))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since job start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[b]) for b in BUCKETS]
    ax.legend(handles, BUCKETS, ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
