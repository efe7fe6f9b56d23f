"""The failure simulation: hand-checked replays, determinism, agreement with the closed form,
and the ``simulate`` subcommand."""

from __future__ import annotations

import argparse
import ast
import json
import random
from pathlib import Path

import pytest

from ray_goodput.cli._plan import register
from ray_goodput.errors import ConfigError
from ray_goodput.plan import DEFAULT_SYSTEMS, System, expected_buckets, optimal_interval_s, replay, simulate
from ray_goodput.plan._simulate import BUCKETS, poisson_schedule, system_to_json

TOY = dict(step_s=1.0, save_blocking_s=2.0, durable_s=5.0, restore_s=3.0, restart_s=10.0, interval=10.0)


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ray-goodput")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def test_replay_of_a_failure_during_a_save_loses_the_interval_before_it():
    # compute 0-10, save 10-12 (durable 15), compute 12-22, save 22-24 (durable 27): the
    # failure at 23 restores progress 10; restart 23-33, restore 33-36, then 20 s more of
    # compute and one save: the job ends at 58 s with 30 s kept.
    out = replay(System(name="toy", **TOY), [23.0], work_s=30.0)
    assert out.seconds == pytest.approx(
        {"productive": 30, "lost": 10, "checkpoint_stall": 5, "restore": 3, "restart_downtime": 10, "startup": 0}
    )
    assert out.failures == 1 and out.wall_s == pytest.approx(58)
    assert out.goodput == pytest.approx(30 / 58)


def test_daly_alone_saves_closer_than_the_upload_and_loses_goodput_to_the_bound():
    """One upload at a time, one waiting, the newest wins. With cheap saves (10 ms) and an
    8 s upload at a 200 s MTBF, Daly's interval alone is 2 s: most of its saves are
    superseded while the recovery point still lands once per upload, so it keeps less than
    the interval the bound gives (the upload, 8 s), on the same failures."""
    costs = dict(step_s=0.1, save_blocking_s=0.01, durable_s=8.01, restore_s=0.0, restart_s=0.0)
    mtbf = 200.0
    schedule = poisson_schedule(1 / mtbf, 200_000.0, random.Random(3))
    daly = optimal_interval_s(0.01, mtbf)
    assert daly == pytest.approx(2.0, abs=0.05)
    auto = System(name="auto", **costs)
    assert auto.interval_steps(mtbf) == 80  # (8.01 - 0.01) s of 0.1 s steps
    alone = replay(System(name="daly", interval=daly, **costs), schedule, wall_s=200_000.0)
    bounded = replay(auto, schedule, wall_s=200_000.0, mtbf_s=mtbf)
    assert alone.superseded > 10_000 and bounded.superseded == 0
    assert bounded.goodput > alone.goodput + 0.005, (bounded.goodput, alone.goodput)


def test_the_auto_interval_never_goes_below_the_upload_in_the_simulation():
    slow = System(name="auto", step_s=0.1, save_blocking_s=0.29, durable_s=600.29, restore_s=10.0, restart_s=10.0)
    assert slow.interval_steps(192_000.0) == 6000  # Daly alone: 3336 steps, each save superseding the next
    out = simulate([slow], gpus=16384, days=20, seed=1)["auto"][0]
    assert out.superseded == 0 and out.failures > 0


def test_replay_loses_a_save_that_was_not_durable_yet():
    # failure at 14: save 1 stopped blocking at 12 but is durable only at 15.
    lagged = replay(System(name="async", **TOY), [14.0], work_s=30.0)
    assert lagged.seconds["lost"] == pytest.approx(12)
    synced = replay(System(name="sync", **{**TOY, "durable_s": 2.0}), [14.0], work_s=30.0)
    assert synced.seconds["lost"] == pytest.approx(2)


def test_replay_failure_during_restart_starts_the_restart_over():
    out = replay(System(name="toy", **TOY), [23.0, 30.0], work_s=30.0)
    assert out.failures == 2
    assert out.seconds["restart_downtime"] == pytest.approx(7 + 10)
    assert out.seconds["lost"] == pytest.approx(10)  # lost once
    assert out.wall_s == pytest.approx(65)


def test_replay_startup_is_not_interrupted_and_ends_at_the_wall():
    out = replay(System(name="toy", **TOY), [1.0], wall_s=20.0, startup_s=4.0)
    assert out.failures == 0 and out.seconds["startup"] == 4
    assert out.wall_s == pytest.approx(20)
    assert out.seconds["productive"] == pytest.approx(14) and out.seconds["checkpoint_stall"] == 2


def test_simulation_is_deterministic_for_a_seed():
    a = simulate(list(DEFAULT_SYSTEMS), gpus=16384, days=30, seed=7, runs=3)
    b = simulate(list(DEFAULT_SYSTEMS), gpus=16384, days=30, seed=7, runs=3)
    c = simulate(list(DEFAULT_SYSTEMS), gpus=16384, days=30, seed=8, runs=3)
    key = lambda res: [(o.failures, round(o.seconds["lost"], 6)) for outs in res.values() for o in outs]  # noqa: E731 - a one-line sort key
    assert key(a) == key(b)
    assert key(a) != key(c)
    first = [o.failures for o in a[DEFAULT_SYSTEMS[0].name]]
    assert all([o.failures for o in outs] == first for outs in a.values())  # same schedules


def test_simulated_buckets_match_the_closed_form_over_a_long_run():
    mtbf = 3600.0
    system = System(name="x", step_s=1.0, save_blocking_s=30, durable_s=200, restore_s=60, restart_s=300, interval=600)
    out = replay(system, poisson_schedule(1 / mtbf, 5000 * mtbf, random.Random(3)), wall_s=5000 * mtbf)
    assert out.failures > 4500
    want = expected_buckets(1.0, 30, 600, mtbf, 300, 60, durable_s=200)
    for bucket, share in want.items():
        assert out.seconds[bucket] / out.wall_s == pytest.approx(share, abs=0.005), bucket


def test_buckets_are_the_goodput_ledger_buckets():
    # Read the ledger's names from its source: importing it would import Ray (seconds).
    source = (Path(__file__).resolve().parents[1] / "ray_goodput/goodput/_ledger.py").read_text()
    (node,) = [
        n for n in ast.parse(source).body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "BUCKETS"
    ]
    assert set(BUCKETS) <= set(ast.literal_eval(node.value))


def test_auto_interval_beats_a_long_fixed_one_at_scale():
    auto = next(s for s in DEFAULT_SYSTEMS if s.name == "ray_goodput auto")
    fixed = System(**{**system_to_json(auto), "name": "fixed 3h", "interval": 3 * 3600.0})
    res = simulate([auto, fixed], gpus=16384, days=30, seed=0, runs=10)
    goodput = {k: sum(o.seconds["productive"] for o in v) / sum(o.wall_s for o in v) for k, v in res.items()}
    assert goodput["ray_goodput auto"] > goodput["fixed 3h"]


def test_system_rejects_bad_costs():
    with pytest.raises(ConfigError, match="durable_s"):
        System(name="x", **{**TOY, "durable_s": 1.0})
    with pytest.raises(ConfigError, match="interval"):
        System(name="x", **{**TOY, "interval": "often"})
    with pytest.raises(ConfigError, match="mtbf_s"):
        replay(System(name="x", **{**TOY, "interval": "auto"}), [], wall_s=10)


def test_simulate_command_prints_a_table_and_writes_a_png(capsys, tmp_path):
    png = tmp_path / "goodput.png"
    args = _cli("simulate", "--gpus", "256,16384", "--runs", "2", "--png", str(png))
    assert args.fn(args) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| 256 |") or ln.startswith("| 16384 |")]
    assert len(rows) == 2 * len(DEFAULT_SYSTEMS)
    assert "| GPUs | MTBF h | system |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_json_reads_costs_from_a_file(capsys, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(
        json.dumps(
            {
                "source": "unit test",
                "systems": [
                    {
                        "name": "slow",
                        "step_s": 1,
                        "save_blocking_s": 60,
                        "durable_s": 60,
                        "restore_s": 30,
                        "restart_s": 60,
                    },
                    {
                        "name": "fast",
                        "step_s": 1,
                        "save_blocking_s": 1,
                        "durable_s": 60,
                        "restore_s": 30,
                        "restart_s": 60,
                        "interval": "auto",
                    },
                ],
            }
        )
    )
    args = _cli("simulate", "--costs", str(costs), "--gpus", "4096", "--afr", "0.5", "--runs", "3", "--json")
    assert args.fn(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == "unit test"
    by_name = {r["system"]: r for r in doc["rows"]}
    assert by_name["fast"]["goodput"] > by_name["slow"]["goodput"]
    assert abs(by_name["slow"]["goodput"] - by_name["slow"]["expected_goodput"]) < 0.02


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--gpus", "a,b"], "--gpus"),
        (["--afr", "-1"], "--afr"),
        (["--costs", "/nonexistent/costs.json"], "--costs"),
    ],
)
def test_simulate_bad_flag_raises_config_error_naming_it(flags, flag):
    args = _cli("simulate", *flags)
    with pytest.raises(ConfigError, match=flag):
        args.fn(args)


def test_costs_json_without_a_field_names_it(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"systems": [{"name": "x", "step_s": 1}]}))
    args = _cli("simulate", "--costs", str(costs))
    with pytest.raises(ConfigError, match="save_blocking_s"):
        args.fn(args)


def test_replay_job_end_on_a_save_boundary_adds_no_extra_save_from_rounding():
    # 0.1 + 0.2 + ... misses 0.9 by a rounding error; the job must still end after 3 intervals, 2 saves.
    system = System(name="x", step_s=0.1, save_blocking_s=0.05, durable_s=0.05, restore_s=0, restart_s=0, interval=0.3)
    for work, saves in ((0.3, 0), (0.9, 2), (2.1, 6), (0.7, 2)):
        out = replay(system, [], work_s=work)
        assert out.seconds["checkpoint_stall"] == pytest.approx(0.05 * saves), work
        assert out.seconds["productive"] == pytest.approx(work)
