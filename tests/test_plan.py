"""ray_goodput.plan: the closed forms, the auto-interval core and the ``plan`` subcommand."""

from __future__ import annotations

import argparse
import ast
import json
import math
from pathlib import Path

import pytest

from ray_goodput.cli._plan import register
from ray_goodput.errors import ConfigError
from ray_goodput.plan import (
    AutoInterval,
    expected_buckets,
    expected_goodput,
    expected_lost_s,
    failure_probability,
    mtbf_hours,
    optimal_interval_s,
    young_interval_s,
)

PLAN_DIR = Path(__file__).resolve().parents[1] / "ray_goodput" / "plan"


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ray-goodput")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def _run(capsys, *argv: str) -> str:
    args = _cli(*argv)
    assert args.fn(args) == 0
    return capsys.readouterr().out


# ---- formulas ------------------------------------------------------------------------


def test_failure_probability_reproduces_19_and_57_percent_over_30_days():
    # 256 * 0.01 * 720/8760 = 0.2104 -> 1 - exp(-0.2104) = 0.1897
    assert failure_probability(256, 30 * 24) == pytest.approx(0.1897, abs=5e-4)
    # 1024 * 0.01 * 720/8760 = 0.8416 -> 1 - exp(-0.8416) = 0.5690
    assert failure_probability(1024, 30 * 24, afr=0.01) == pytest.approx(0.5690, abs=5e-4)
    assert failure_probability(1024, 0) == 0.0


def test_mtbf_hours_is_8760_over_gpu_years():
    assert mtbf_hours(1024) == pytest.approx(855.47, abs=0.01)  # 8760 / 10.24
    assert mtbf_hours(608, afr=0.05) == pytest.approx(8760 / 30.4)


def test_optimal_interval_for_the_608_gpu_cluster_failing_every_1_9_hours():
    mtbf = 1.9 * 3600  # 6840 s
    # By hand, save 60 s: Young sqrt(2*60*6840) = sqrt(820800) = 905.98 s;
    # d/(2M) = 0.0043860, so Daly = 905.98 * (1 + 0.066227/3 + 0.0043860/9) - 60 = 866.42 s.
    assert young_interval_s(60, mtbf) == pytest.approx(905.98, abs=0.01)
    assert optimal_interval_s(60, mtbf) == pytest.approx(866.42, abs=0.01)
    # Save 17.94 s (rank-0 torch.save to S3): sqrt(2*17.94*6840) = 495.39 s; d/(2M) = 0.0013114;
    # 495.39 * (1 + 0.036213/3 + 0.0013114/9) - 17.94 = 483.50 s.
    assert optimal_interval_s(17.94, mtbf) == pytest.approx(483.50, abs=0.02)


def test_young_is_the_limit_of_daly_for_small_save_cost():
    mtbf = 100_000.0
    gaps = [abs(optimal_interval_s(d, mtbf) / young_interval_s(d, mtbf) - 1) for d in (100, 10, 1, 0.01)]
    assert gaps == sorted(gaps, reverse=True) and gaps[0] > 0.005
    # The relative gap is about (1/3 - 1) * sqrt(d/(2M)): 1.5e-4 for d = 0.01 s, M = 1e5 s.
    assert gaps[-1] == pytest.approx(2 / 3 * math.sqrt(0.01 / 2e5), rel=0.01)


def test_daly_saves_once_per_mtbf_when_a_save_costs_two_mtbfs():
    assert optimal_interval_s(500, 200) == 200
    assert optimal_interval_s(399, 200) < 200 + 1e-9  # just below the regime: formula branch


def test_restart_cost_does_not_move_the_optimum_but_lowers_goodput():
    assert optimal_interval_s(30, 7200, restart_s=600) == optimal_interval_s(30, 7200)
    fast = expected_goodput(1, 30, 600, 7200, 60, 0)
    slow = expected_goodput(1, 30, 600, 7200, 600, 0)
    assert slow < fast


def test_expected_goodput_peaks_near_the_optimal_interval():
    mtbf, save = 6840.0, 60.0
    best = optimal_interval_s(save, mtbf)
    at_best = expected_goodput(1, save, best, mtbf, 300, 60)
    for other in (best / 3, best * 3):
        assert expected_goodput(1, save, other, mtbf, 300, 60) < at_best - 0.005


def test_expected_buckets_sum_to_one_and_match_the_first_order_model():
    b = expected_buckets(1, 2, 1000, 1e7, 100, 50, durable_s=30)
    assert sum(b.values()) == pytest.approx(1.0)
    # first order: 1 - G ~= d/(t+d) + (t/2 + t*(D - d + R + Tr)/(t+d))/M
    first = 2 / 1002 + (500 + 1000 * (28 + 150) / 1002) / 1e7
    assert 1 - b["productive"] == pytest.approx(first, rel=1e-4)


def test_expected_buckets_of_restarts_far_longer_than_the_mtbf_are_shares_not_an_overflow():
    """A restart of 1000 s against a 0.36 s MTBF: the model's exp((R + Tr)/M) overflowed and
    ``ray-goodput plan`` ended in a traceback. The answer is a run that almost never gets
    through its restarts: goodput 0, nearly all restart downtime."""
    b = expected_buckets(1, 1, 10, 0.36, 1000, 10, durable_s=5)
    assert sum(b.values()) == pytest.approx(1.0)
    assert b["productive"] == 0.0 and b["restart_downtime"] == pytest.approx(1.0)
    huge_interval = expected_buckets(1, 1, 1e6, 10.0, 0, 0)  # expm1(1e5) overflowed too
    assert sum(huge_interval.values()) == pytest.approx(1.0) and huge_interval["productive"] == 0.0


def test_plan_for_restarts_far_longer_than_the_mtbf_prints_a_goodput_of_zero(capsys):
    argv = ["--gpus", "1", "--hours", "1", "--mtbf-hours", "0.0001", "--save-seconds", "1", "--restart-seconds", "1000"]
    out = _run(capsys, "plan", *argv)
    assert "expected goodput" in out


def test_expected_lost_work_is_about_half_an_interval_plus_the_durability_lag():
    sync = expected_lost_s(1, 1, 1000, 1e8)
    lagged = expected_lost_s(1, 1, 1000, 1e8, durable_s=101)
    assert sync == pytest.approx(500, rel=1e-3)
    assert lagged - sync == pytest.approx(1000 * 100 / 1001, rel=1e-3)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: failure_probability(0, 10), "gpus"),
        (lambda: failure_probability(8, -1), "hours"),
        (lambda: mtbf_hours(8, afr=0), "afr"),
        (lambda: optimal_interval_s(0, 100), "save_s"),
        (lambda: optimal_interval_s(1, float("nan")), "mtbf_s"),
        (lambda: optimal_interval_s(1, 100, restart_s=-1), "restart_s"),
        (lambda: expected_goodput(0, 1, 10, 100, 0, 0), "step_s"),
        (lambda: expected_goodput(1, 5, 10, 100, 0, 0, durable_s=2), "durable_s"),
    ],
)
def test_bad_input_raises_config_error_naming_the_argument(call, name):
    with pytest.raises(ConfigError, match=name):
        call()


def test_plan_modules_import_neither_ray_nor_torch():
    allowed = {
        "__future__",
        "argparse",
        "json",
        "logging",
        "math",
        "random",
        "statistics",
        "sys",
        "collections",
        "dataclasses",
        "pathlib",
        "typing",
        "ray_goodput",
    }
    for path in PLAN_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                top = name.split(".")[0]
                assert top in allowed | {"matplotlib"}, f"{path.name} imports {name}"
                assert name.startswith(("ray_goodput.plan", "ray_goodput.errors")) or top != "ray_goodput", (
                    f"{path.name} imports {name}"
                )


# ---- AutoInterval ----------------------------------------------------------------------


def test_the_optimal_interval_is_never_shorter_than_the_upload():
    """A 6.1 s interval against tens of seconds to durable only superseded saves (the S3
    Poisson benchmark): the interval now waits out the upload."""
    daly = optimal_interval_s(0.29, 192_000.0)  # 16,384 GPUs at 1% AFR
    assert daly == pytest.approx(333.6, abs=0.5)
    assert optimal_interval_s(0.29, 192_000.0, durable_s=18.88) == daly  # the upload is shorter
    assert optimal_interval_s(0.29, 192_000.0, durable_s=600.29) == pytest.approx(600.0)
    assert optimal_interval_s(5.0, 2.0, durable_s=60.0) == 55.0  # also past Daly's once-per-MTBF cap
    with pytest.raises(ConfigError, match="durable_s"):
        optimal_interval_s(1.0, 100.0, durable_s=0.5)


def test_auto_interval_waits_out_the_measured_time_to_durable():
    auto = AutoInterval(world_size=16384, warmup_steps=10)
    for _ in range(5):
        auto.observe_step(0.1)
        auto.observe_save(0.29)
    assert auto.proposal() == round(optimal_interval_s(0.29, auto.mtbf_s) / 0.1)  # nothing measured to durable
    for seconds in (590.0, 600.29, 610.0):
        auto.observe_durable(seconds)
    assert auto.durable_s == pytest.approx(600.29)
    assert auto.proposal() == 6000  # (600.29 - 0.29) s of 0.1 s steps, not Daly's 3336


def test_auto_interval_uses_warmup_until_a_save_is_measured():
    auto = AutoInterval(world_size=1024, warmup_steps=10)
    assert auto.mtbf_s == pytest.approx(855.47 * 3600, rel=1e-4)
    assert auto.interval_steps() == 10 and auto.proposal() == 10
    assert not auto.due(9, None) and auto.due(10, None)
    for _ in range(5):
        auto.observe_step(0.5)
    assert auto.proposal() == 10  # step time alone is not enough


def test_auto_interval_proposes_daly_in_steps_and_reports_changes():
    auto = AutoInterval(world_size=8, mtbf_hours=1.9, warmup_steps=10)
    for seconds in (0.9, 1.0, 1.1, 5.0):  # one slow step: the median ignores it
        auto.observe_step(seconds)
    auto.observe_save(60.0)
    steps = auto.proposal()
    assert steps == round(optimal_interval_s(60.0, 6840.0) / 1.05)  # 866.42 / 1.05 -> 825
    assert auto.adopt(steps) is True
    assert auto.adopt(steps) is False
    assert auto.interval_steps() == 825
    assert not auto.due(1024, 200) and auto.due(1025, 200)


def test_auto_interval_keeps_the_interval_for_small_changes():
    auto = AutoInterval(world_size=8, mtbf_hours=1.9, warmup_steps=10, min_change=0.1)
    auto.observe_step(1.0)
    auto.observe_save(60.0)
    assert auto.adopt(auto.proposal())
    auto.observe_save(66.0)  # median 63 s -> interval ~3% longer: within 10%, kept
    assert auto.proposal() == auto.interval_steps()
    for _ in range(4):
        auto.observe_save(240.0)  # median 240 s -> about twice as long: changes
    assert auto.proposal() > 1.5 * auto.interval_steps()


def test_ranks_with_different_measurements_decide_the_same_after_adopting_rank_0():
    ranks = [AutoInterval(world_size=4, mtbf_hours=2.0, warmup_steps=5) for _ in range(4)]
    for i, auto in enumerate(ranks):
        auto.observe_step(0.1 * (1 + i))
        auto.observe_save(2.0 + i)
    assert len({a.proposal() for a in ranks}) == 4  # rank-local opinions differ
    shared = ranks[0].proposal()  # broadcast by rank 0 inside a save
    for auto in ranks:
        auto.adopt(shared)
    for step in range(0, 3 * shared, 7):
        assert len({a.due(step, 3) for a in ranks}) == 1


def test_auto_interval_rejects_bad_settings():
    with pytest.raises(ConfigError, match="warmup_steps"):
        AutoInterval(world_size=4, warmup_steps=0)
    with pytest.raises(ConfigError, match="mtbf_hours"):
        AutoInterval(world_size=4, mtbf_hours=-1)
    with pytest.raises(ConfigError, match="gpus"):
        AutoInterval(world_size=0)
    with pytest.raises(ConfigError, match="interval steps"):
        AutoInterval(world_size=4).adopt(0)


# ---- ray-goodput plan ------------------------------------------------------------------


def test_plan_prints_failure_odds_mtbf_interval_and_goodput(capsys):
    out = _run(
        capsys,
        "plan",
        "--gpus",
        "1024",
        "--days",
        "30",
        "--save-seconds",
        "0.29",
        "--durable-seconds",
        "18.88",
        "--restart-seconds",
        "12",
        "--restore-seconds",
        "14",
        "--compare-save-seconds",
        "17.94",
    )
    assert "failure probability over the run    56.9%" in out
    assert "job MTBF                            855.47 h" in out
    interval_line = next(ln for ln in out.splitlines() if ln.startswith("optimal interval"))
    fast = optimal_interval_s(0.29, 855.47 * 3600)
    slow = optimal_interval_s(17.94, 855.47 * 3600)
    assert interval_line.split()[3:] == [f"{fast:.0f}", "s", f"{slow:.0f}", "s"]
    assert "expected goodput" in out and "save 17.94 s" in out


def test_plan_json_has_the_numbers_and_the_comparison(capsys):
    out = _run(
        capsys,
        "plan",
        "--gpus",
        "608",
        "--hours",
        "24",
        "--mtbf-hours",
        "1.9",
        "--save-seconds",
        "60",
        "--restart-seconds",
        "600",
        "--compare-save-seconds",
        "5",
        "--json",
    )
    doc = json.loads(out)
    assert doc["mtbf_hours"] == pytest.approx(1.9)
    assert doc["failure_probability"] == pytest.approx(1 - math.exp(-24 / 1.9))
    assert doc["optimal_interval_s"] == pytest.approx(866.42, abs=0.01)
    assert doc["expected_goodput"] == pytest.approx(expected_goodput(1, 60, 866.42, 6840, 600, 0), abs=1e-4)
    assert doc["compare"]["optimal_interval_s"] == pytest.approx(optimal_interval_s(5, 6840))
    assert doc["compare"]["expected_goodput"] > doc["expected_goodput"]


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--save-seconds", "0"], "--save-seconds"),
        (["--save-seconds", "5", "--gpus", "0"], "--gpus"),
        (["--save-seconds", "5", "--restart-seconds", "-1"], "--restart-seconds"),
        (["--save-seconds", "5", "--afr", "0"], "--afr"),
        (["--save-seconds", "5", "--durable-seconds", "1"], "--durable-seconds"),
        (["--save-seconds", "5", "--compare-save-seconds", "-3"], "--compare-save-seconds"),
    ],
)
def test_plan_bad_flag_raises_config_error_naming_it(flags, flag):
    base = {"--gpus": "8", "--days": "1", "--restart-seconds": "10"}
    for name, value in zip(flags[::2], flags[1::2]):
        base[name] = value
    args = _cli("plan", *[x for kv in base.items() for x in kv])
    with pytest.raises(ConfigError, match=flag):
        args.fn(args)


def test_plan_needs_days_or_hours_not_both():
    with pytest.raises(SystemExit):
        _cli("plan", "--gpus", "8", "--days", "1", "--hours", "3", "--save-seconds", "1", "--restart-seconds", "1")


def test_rounding_the_interval_to_whole_steps_never_takes_it_below_the_upload():
    """Rounding to the nearest step undid the floor: with 6 s steps and an 8 s upload,
    the 8 s interval became one 6 s step, shorter than the time to durable, the regime the
    floor exists to avoid (a save lands once per upload and the rest are superseded)."""
    from ray_goodput.plan._formulas import interval_steps

    assert interval_steps(8.0, 6.0, at_least_s=8.0) == 2
    assert interval_steps(20.0, 6.0, at_least_s=8.0) == 3  # above the floor: nearest, as before
    assert interval_steps(4.0, 6.0, at_least_s=8.0) == 1  # an interval chosen below it stays the user's
    auto = AutoInterval(world_size=8, mtbf_hours=200 / 3600, warmup_steps=10)
    for _ in range(5):
        auto.observe_step(6.0)
        auto.observe_save(0.01)
        auto.observe_durable(8.01)
    assert auto.optimal_interval_s() == pytest.approx(8.0)
    assert auto.proposal() * auto.step_s >= auto.durable_s - auto.save_s
    instant = AutoInterval(world_size=8, mtbf_hours=200 / 3600, warmup_steps=10)
    for _ in range(5):  # a save that blocks for no measurable time
        instant.observe_step(6.0)
        instant.observe_save(0.0)
        instant.observe_durable(8.0)
    assert instant.proposal() * instant.step_s >= instant.durable_s
