"""Closed forms for planning checkpoints: failure odds, MTBF, the optimal interval, goodput.

The model (the same one :mod:`ray_goodput.plan._simulate` runs event by event):

- Each GPU fails independently at a constant rate, ``AFR`` failures per GPU-year, so the
  job (which stops when any of its ``N`` GPUs fails) sees a Poisson process of rate
  ``lambda = N * AFR / 8760`` per hour and ``M = 1 / lambda`` is the job MTBF.
- A run alternates ``tau`` seconds of compute (a whole number of steps) and a save that
  blocks the loop for ``delta`` seconds. A save becomes a recovery point ``D`` seconds after
  it started (``D >= delta``: ``D = delta`` for a synchronous save, more for an async one
  that keeps uploading after the loop resumed). Uploads of successive saves overlap.
- A failure loses the compute done since the newest *durable* checkpoint, then costs ``R``
  (restart: detection, rescheduling, process setup) and ``Tr`` (restore). A failure during
  the restart or the restore starts both over; the lost progress stays lost once.
- The closed forms let uploads overlap. The uploader runs one at a time per rank (a newer
  save supersedes the waiting one), which matches them while the interval is at least
  ``D - delta``; :func:`optimal_interval_s` never goes below that, and the simulation
  (:mod:`ray_goodput.plan._simulate`) runs the one-at-a-time upload lane as it is.

Under that model the expected share of wall time per bucket has an exact closed form
(renewal-reward over the segments between failures, ``x = tau + delta``)::

    productive = tau * exp(-(D - delta)/M) / (M * exp((R + Tr)/M) * (exp(x/M) - 1))

which for ``D = delta`` is Daly's (2006) expected efficiency. To first order in ``1/M``::

    1 - goodput ~= delta/x + (tau/2 + tau*(D - delta + R + Tr)/x) / M

i.e. the save's share of the cycle, plus per failure half an interval of redone compute,
the upload lag and the downtime (the last two weighted by the compute share ``tau/x``).

What it ignores: failures that are not independent or not memoryless (infant mortality,
a bad node that fails again), time between a failure and its detection beyond what ``R``
holds, storage bandwidth shared between ranks (``D`` is taken as fixed), the
slowdown of steps while a background upload runs, startup and the end of the run.
"""

from __future__ import annotations

import math

from ray_goodput.errors import ConfigError

HOURS_PER_YEAR = 8760.0


def positive(name: str, value: float, *, zero_ok: bool = False) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(value) or math.isinf(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def check_gpus(gpus: int) -> int:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"gpus must be an int >= 1, got {gpus!r}")
    return gpus


def failure_probability(gpus: int, hours: float, afr: float = 0.01) -> float:
    """P(at least one failure) over ``hours`` of a job on ``gpus`` GPUs.

    ``P = 1 - exp(-N * AFR * T)`` with ``T = hours / 8760`` in years and ``afr`` the
    annualized failure rate of one GPU (0.01 = 1%). Example: 256 GPUs for 30 days at 1%
    gives 19%, 1,024 GPUs 57%.
    """
    n, t, a = check_gpus(gpus), positive("hours", hours, zero_ok=True), positive("afr", afr)
    return 1.0 - math.exp(-n * a * t / HOURS_PER_YEAR)


def mtbf_hours(gpus: int, afr: float = 0.01) -> float:
    """Mean hours between failures of the whole job: ``8760 / (N * AFR)``."""
    return HOURS_PER_YEAR / (check_gpus(gpus) * positive("afr", afr))


def afr_from_mtbf(gpus: int, mtbf_h: float) -> float:
    """The per-GPU annualized failure rate a measured job MTBF implies: ``8760 / (N * M)``."""
    return HOURS_PER_YEAR / (check_gpus(gpus) * positive("mtbf_hours", mtbf_h))


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimal compute time between saves: ``sqrt(2 * delta * M)``."""
    return math.sqrt(2.0 * positive("save_s", save_s) * positive("mtbf_s", mtbf_s))


def optimal_interval_s(
    save_s: float, mtbf_s: float, restart_s: float = 0.0, *, durable_s: float | None = None
) -> float:
    """Daly's (2006) higher-order optimal compute time between saves, in seconds, and never
    below the upload: with ``durable_s`` (save start to recovery point), at least
    ``durable_s - save_s``.

    A node uploads one save of a rank at a time and keeps at most one more waiting; a save
    that comes while both are taken supersedes the waiting one. So saves closer together
    than the upload only cost their blocking time and are dropped: the recovery point
    still lands once per upload and lags as much. The bound keeps the interval out of that
    regime, where this module's closed forms (which let uploads overlap) would overstate
    the goodput.

    For ``delta < 2M``: ``sqrt(2*delta*M) * (1 + sqrt(delta/(2M))/3 + (delta/(2M))/9) - delta``,
    whose first term is Young's ``sqrt(2*delta*M)``. For ``delta >= 2M`` saving costs more
    than failures do and the formula gives ``M``: save once per MTBF. ``save_s`` is the time
    the loop is blocked by a save. ``restart_s`` is checked but, as in Daly's model, does not
    move the optimum: the restart multiplies the expected run time by ``exp(R/M)`` whatever
    the interval. Nor does an async save's upload time (see :func:`expected_goodput`).
    """
    delta, m = positive("save_s", save_s), positive("mtbf_s", mtbf_s)
    positive("restart_s", restart_s, zero_ok=True)
    upload = 0.0
    if durable_s is not None:
        if positive("durable_s", durable_s, zero_ok=True) < delta:
            raise ConfigError(f"durable_s ({durable_s}) must be >= save_s ({delta}): it counts from the save's start")
        upload = durable_s - delta
    if delta >= 2.0 * m:
        return max(m, upload)
    ratio = delta / (2.0 * m)
    return max(math.sqrt(2.0 * delta * m) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta, upload)


def interval_steps(interval_s: float, step_s: float, *, at_least_s: float = 0.0) -> int:
    """A compute interval as a whole number of steps (nearest, at least 1). An interval at
    or above ``at_least_s`` (the upload: time to durable less the blocking) is not rounded
    below it: ``optimal_interval_s`` keeps the interval out of that regime."""
    interval, step = positive("interval_s", interval_s), positive("step_s", step_s)
    steps = max(1, round(interval / step))
    if interval >= at_least_s > steps * step:
        steps = math.ceil(at_least_s / step)
    return steps


def expected_buckets(
    step_s: float,
    save_s: float,
    interval_s: float,
    mtbf_s: float,
    restart_s: float,
    restore_s: float,
    *,
    durable_s: float | None = None,
) -> dict[str, float]:
    """Expected share of wall time in each ledger bucket (they sum to 1) under the module's model.

    ``interval_s`` is compute time between saves, rounded to whole steps of ``step_s``;
    ``durable_s`` is the time from a save's start until it is a recovery point (default
    ``save_s``: synchronous). Keys: ``productive``, ``lost``, ``checkpoint_stall``,
    ``restore``, ``restart_downtime``.
    """
    delta, m = positive("save_s", save_s, zero_ok=True), positive("mtbf_s", mtbf_s)
    r, tr = positive("restart_s", restart_s, zero_ok=True), positive("restore_s", restore_s, zero_ok=True)
    d = delta if durable_s is None else positive("durable_s", durable_s, zero_ok=True)
    tau = interval_steps(interval_s, step_s, at_least_s=d - delta) * step_s
    if d < delta:
        raise ConfigError(f"durable_s ({d}) must be >= save_s ({delta}): a save is durable after it stops blocking")
    # Per segment between failures (expected length M): the compute done, and what its
    # durable saves kept, as shares of M. A failure costs exp((R + Tr)/M) restart+restore
    # attempts; each share is taken of the wall time that includes them, with the
    # exponentials of long restarts or intervals (far beyond M) falling to 0, not overflowing.
    computed = -math.expm1(-tau / m) / -math.expm1(-(tau + delta) / m)
    kept = (tau / m) * _exp_over_expm1(-(d - delta) / m, (tau + delta) / m)
    running = math.exp(-(r + tr) / m)  # the share of wall time in segments, not restarts
    return {
        "productive": kept * running,
        "lost": (computed - kept) * running,
        "checkpoint_stall": (1.0 - computed) * running,
        "restart_downtime": -math.expm1(-r / m),
        "restore": math.exp(-r / m) * -math.expm1(-tr / m),
    }


def _exp_over_expm1(a: float, y: float) -> float:
    """``exp(a) / expm1(y)`` for ``a <= 0 < y``, without overflow for a large ``y``."""
    return math.exp(a - y) / -math.expm1(-y)


def expected_goodput(
    step_s: float,
    save_s: float,
    interval_s: float,
    mtbf_s: float,
    restart_s: float,
    restore_s: float,
    *,
    durable_s: float | None = None,
) -> float:
    """Expected productive share of wall time (see the module docstring for the formula)."""
    return expected_buckets(step_s, save_s, interval_s, mtbf_s, restart_s, restore_s, durable_s=durable_s)["productive"]


def expected_lost_s(
    step_s: float, save_s: float, interval_s: float, mtbf_s: float, *, durable_s: float | None = None
) -> float:
    """Expected compute seconds a failure throws away: about ``tau/2 + tau*(D - delta)/(tau + delta)``.

    Exact under the model: compute done in a segment minus what its durable saves kept.
    """
    b = expected_buckets(step_s, save_s, interval_s, mtbf_s, 0.0, 0.0, durable_s=durable_s)
    m = positive("mtbf_s", mtbf_s)
    return b["lost"] * m  # one failure per segment of expected length M
