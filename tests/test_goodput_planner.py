"""The goodput planner and ``ray-resilient goodput plan``: the model against numbers worked out by
hand here (and the brief's examples), duration parsing, and the command line's output and errors."""

from __future__ import annotations

import json
import math

import pytest

from ray_resilient.cli import main
from ray_resilient.goodput.planner import (
    MeasuredInputs,
    daly_interval,
    expected_goodput,
    expected_lost_per_failure,
    failure_stats,
    interval_steps_for,
    make_plan,
    mtbf_from_annual_failure_rate,
    parse_duration,
    plan_from_measured,
    young_interval,
)

YEAR_S = 365 * 86400
DAY_S = 86400


# --- durations -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("1.5h", 5400.0),
        ("1d", 86400.0),
        ("90", 90.0),
        ("2.5", 2.5),
        ("250ms", 0.25),
        (" 2 h ", 7200.0),
        (".5m", 30.0),
        ("0", 0.0),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "-5s", "1e3", "5 minutes", "h", "1.5.2h"])
def test_parse_duration_rejects_bad_text_naming_it_and_the_units(text):
    with pytest.raises(ValueError) as error:
        parse_duration(text)
    assert repr(text) in str(error.value)
    assert "ms, s, m, h, d" in str(error.value)


# --- failure rates ---------------------------------------------------------------------------


def test_mtbf_from_annual_failure_rate_is_exponential_with_that_annual_probability():
    # One GPU: P(fails within a year) must be exactly the given rate.
    mtbf = mtbf_from_annual_failure_rate(1, 0.05)
    assert 1 - math.exp(-YEAR_S / mtbf) == pytest.approx(0.05)
    # 1024 GPUs: rate -ln(0.95) = 0.051293 per GPU-year, so MTBF = 1 year / (1024 * 0.051293).
    assert mtbf_from_annual_failure_rate(1024, 0.05) == pytest.approx(YEAR_S / (1024 * 0.0512933))


@pytest.mark.parametrize(("gpus", "expected"), [(256, 0.19), (1024, 0.57)])
def test_brief_examples_of_failing_at_least_once_in_30_days(gpus, expected):
    # The brief: 1% per GPU a year, 30 days: about 19% at 256 GPUs and 57% at 1,024.
    stats = failure_stats(mtbf_from_annual_failure_rate(gpus, 0.01), 30 * DAY_S)
    assert stats.p_any_failure == pytest.approx(expected, abs=0.005)


def test_failure_stats():
    stats = failure_stats(7200, DAY_S)  # 2 h MTBF over a day: 12 failures expected
    assert stats.expected_failures == pytest.approx(12)
    assert stats.p_any_failure == pytest.approx(1 - math.exp(-12))
    assert failure_stats(7200, 0).p_any_failure == 0


# --- lost work and goodput -------------------------------------------------------------------


@pytest.mark.parametrize(("interval_s", "expected"), [(7200, 0.6417), (1800, 0.9104)])
def test_brief_examples_of_goodput_at_8_6_failures_a_day(interval_s, expected):
    # The brief: 8.6 failures/day; a 2 h interval gives goodput ~64%, 30 min ~91% (half an
    # interval lost per failure, no stall, no restart): 1 - (I/2) / (24 h / 8.6).
    mtbf = DAY_S / 8.6
    assert expected_goodput(interval_s, 0, 0, mtbf) == pytest.approx(expected, abs=1e-4)


def test_goodput_with_save_stall_restart_and_durable_latency():
    mtbf = DAY_S / 8.6  # 10046.51 s
    # Cycle 1800 + 10 s; a failure loses half a cycle (905 s) + restart 300 s + latency 60 s.
    assert expected_lost_per_failure(1800, 10, 300, 60) == pytest.approx(1265)
    expected = 1800 / 1810 * (1 - 1265 / 10046.5116)  # = 0.99448 * 0.87408
    assert expected_goodput(1800, 10, 300, mtbf, 60) == pytest.approx(expected)
    assert expected_goodput(1800, 10, 300, mtbf, 60) == pytest.approx(0.86926, abs=1e-5)


def test_goodput_is_zero_when_a_failure_costs_more_than_the_mtbf():
    assert expected_goodput(interval_s=10_000, save_stall_s=10, restart_s=0, mtbf_s=3000) == 0


# --- optimal intervals -----------------------------------------------------------------------


def test_young_interval():
    assert young_interval(10, 10_000) == pytest.approx(447.2136, abs=1e-4)  # sqrt(200000)


def test_daly_interval_below_twice_the_mtbf():
    # S = 10, M = 10000: x = S/2M = 0.0005, sqrt(x) = 0.02236068,
    # tau = 447.2136 * (1 + 0.02236068/3 + 0.0005/9) - 10 = 447.2136 * 1.0075091 - 10.
    assert daly_interval(10, 10_000) == pytest.approx(440.5718, abs=1e-3)
    # Just below the boundary the formula still applies: S = 399, M = 200.
    x = 399 / 400
    expected = math.sqrt(2 * 399 * 200) * (1 + math.sqrt(x) / 3 + x / 9) - 399
    assert daly_interval(399, 200) == pytest.approx(expected)


@pytest.mark.parametrize("save_stall_s", [400, 1000])
def test_daly_interval_is_the_mtbf_from_twice_the_mtbf(save_stall_s):
    assert daly_interval(save_stall_s, 200) == 200


def test_interval_steps_for_rounds_daly_to_whole_steps_at_least_one():
    assert interval_steps_for(10_000, 10, 3.0) == 147  # 440.57 / 3 = 146.86
    assert interval_steps_for(10_000, 10, 1000.0) == 1  # 0.44 steps


def test_the_interval_is_never_shorter_than_a_save_takes_to_become_durable():
    assert interval_steps_for(10_000, 10, 3.0, durable_s=300) == 147  # Daly's is longer
    assert interval_steps_for(10_000, 10, 3.0, durable_s=600) == 200  # writes one after another
    plan = plan_from_measured(MeasuredInputs(save_stall_s=10, restart_s=None, step_s=3.0, durable_latency_s=600),
                              10_000)
    assert plan.recommended_interval_steps == 200 and plan.recommended_interval_s == 600


@pytest.mark.parametrize(
    "call",
    [
        lambda: young_interval(-1, 100),
        lambda: daly_interval(10, 0),
        lambda: expected_goodput(0, 10, 0, 100),
        lambda: expected_goodput(100, -1, 0, 100),
        lambda: failure_stats(100, -1),
        lambda: interval_steps_for(100, 10, 0),
        lambda: mtbf_from_annual_failure_rate(0, 0.05),
        lambda: mtbf_from_annual_failure_rate(8, 1.0),
        lambda: make_plan(100, restart_s=-1),
        lambda: make_plan(100, interval_s=0),
    ],
)
def test_bad_values_raise_value_errors(call):
    with pytest.raises(ValueError, match="must be"):
        call()


# --- plans -----------------------------------------------------------------------------------


def test_make_plan_with_every_input():
    mtbf, run = 10_000.0, 2 * DAY_S
    plan = make_plan(
        mtbf, run_s=run, save_stall_s=10, restart_s=120, interval_s=600, step_s=3.0,
        durable_latency_s=30,
    )
    assert plan.failures_per_day == pytest.approx(8.64)
    assert plan.expected_failures == pytest.approx(17.28)
    assert plan.p_any_failure == pytest.approx(1 - math.exp(-17.28))
    assert plan.young_interval_s == pytest.approx(447.2136, abs=1e-4)
    assert plan.daly_interval_s == pytest.approx(440.5718, abs=1e-3)
    assert plan.recommended_interval_steps == 147
    assert plan.recommended_interval_s == pytest.approx(441.0)
    # At 600 s: lost = 610/2 + 120 + 30 = 455 s per failure, 455 * 8.64 per day.
    assert plan.lost_per_failure_s == pytest.approx(455)
    assert plan.lost_per_day_s == pytest.approx(455 * 8.64)
    assert plan.goodput == pytest.approx(600 / 610 * (1 - 455 / 10_000))
    daly = plan.daly_interval_s
    assert plan.optimal_goodput == pytest.approx(
        daly / (daly + 10) * (1 - ((daly + 10) / 2 + 150) / 10_000)
    )
    # The table: 1/8x..8x the optimum, Young's and the given interval, shortest first.
    intervals = [row.interval_s for row in plan.table]
    assert intervals == sorted(intervals) and len(intervals) == 9
    assert intervals[0] == pytest.approx(daly / 8) and intervals[-1] == pytest.approx(daly * 8)
    labels = {row.label: row.interval_s for row in plan.table if row.label}
    assert labels == {"Daly (optimal)": daly, "Young": plan.young_interval_s, "given": 600}
    assert max(plan.table, key=lambda row: row.goodput).interval_s in (daly, plan.young_interval_s)


def test_make_plan_leaves_what_it_cannot_know_none():
    plan = make_plan(7200)
    assert plan.failures_per_day == pytest.approx(12)
    for name in (
        "p_any_failure", "expected_failures", "young_interval_s", "daly_interval_s",
        "optimal_goodput", "recommended_interval_s", "recommended_interval_steps",
        "lost_per_failure_s", "lost_per_day_s", "goodput",
    ):
        assert getattr(plan, name) is None, name
    assert plan.table == ()
    # An interval without a save stall still has no goodput; a save stall without an interval has
    # the optimum but no goodput at a given interval.
    assert make_plan(7200, interval_s=600).goodput is None
    plan = make_plan(7200, save_stall_s=10)
    assert plan.goodput is None and plan.optimal_goodput is not None
    assert plan.recommended_interval_s == plan.daly_interval_s
    assert plan.recommended_interval_steps is None


def test_free_saves_have_no_optimum_above_zero_and_recommend_the_shortest_interval_saves_allow():
    mtbf = DAY_S / 8.6
    assert young_interval(0, mtbf) == 0 and daly_interval(0, mtbf) == 0
    plan = make_plan(mtbf, save_stall_s=0, interval_s=7200)
    assert plan.goodput == pytest.approx(1 - 3600 / mtbf)  # the brief's 64%
    assert plan.optimal_goodput is None and plan.recommended_interval_s is None
    # No optimum to centre the table on: it spans the given interval, 1/8x to 8x.
    assert [row.interval_s for row in plan.table] == [7200 * f for f in (0.125, 0.25, 0.5, 1, 2, 4, 8)]
    assert [row.label for row in plan.table if row.label] == ["given"]
    assert make_plan(mtbf, save_stall_s=0).table == ()
    assert make_plan(mtbf, save_stall_s=0, step_s=3.0).recommended_interval_steps == 1  # every step
    slow_uploads = make_plan(mtbf, save_stall_s=0, step_s=3.0, durable_latency_s=600)
    assert slow_uploads.recommended_interval_steps == 200 and slow_uploads.recommended_interval_s == 600


def test_plan_from_measured_uses_the_measured_costs():
    plan = plan_from_measured(MeasuredInputs(save_stall_s=10, restart_s=None, step_s=3.0), 10_000)
    assert plan.save_stall_s == 10 and plan.restart_s == 0 and plan.step_s == 3.0
    assert plan.recommended_interval_steps == 147


# --- the command line ------------------------------------------------------------------------


def run_cli(capsys, *args: str) -> str:
    assert main(["goodput", "plan", *args]) == 0
    return capsys.readouterr().out


def cli_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["goodput", "plan", *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_cli_json_with_every_input(capsys):
    out = run_cli(
        capsys, "--gpus", "1024", "--annual-failure-rate", "5%", "--days", "30",
        "--save-stall", "10s", "--restart", "5m", "--interval", "30m", "--json",
    )
    result = json.loads(out)
    mtbf = YEAR_S / (1024 * -math.log(0.95))  # 6.95 days
    run = 30 * DAY_S
    assert result["expected_failures"] == pytest.approx(run / mtbf)
    assert result["p_any_failure"] == pytest.approx(1 - math.exp(-run / mtbf))
    assert result["young_interval_s"] == pytest.approx(math.sqrt(2 * 10 * mtbf))
    x = 10 / (2 * mtbf)
    daly = math.sqrt(2 * 10 * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - 10
    assert result["daly_interval_s"] == pytest.approx(daly)
    assert result["goodput"] == pytest.approx(1800 / 1810 * (1 - (905 + 300) / mtbf))
    assert result["lost_per_failure_s"] == pytest.approx(1205)
    assert len(result["table"]) == 9


def test_cli_json_has_nulls_for_missing_inputs(capsys):
    result = json.loads(run_cli(capsys, "--failures-per-day", "8.6", "--json"))
    assert result["mtbf_s"] == pytest.approx(DAY_S / 8.6)
    for key in ("p_any_failure", "expected_failures", "goodput", "young_interval_s",
                "daly_interval_s", "optimal_goodput"):
        assert key in result and result[key] is None, key
    result = json.loads(run_cli(capsys, "--mtbf-hours", "2", "--save-stall", "10", "--json"))
    assert result["mtbf_s"] == 7200
    assert result["goodput"] is None
    assert result["optimal_goodput"] == pytest.approx(
        expected_goodput(result["daly_interval_s"], 10, 0, 7200)
    )


def test_cli_annual_rate_as_fraction_or_percent(capsys):
    as_percent = json.loads(run_cli(capsys, "--gpus", "8", "--annual-failure-rate", "5%", "--json"))
    as_fraction = json.loads(
        run_cli(capsys, "--gpus", "8", "--annual-failure-rate", "0.05", "--json")
    )
    assert as_percent["mtbf_s"] == pytest.approx(as_fraction["mtbf_s"])
    assert as_percent["mtbf_s"] == pytest.approx(YEAR_S / (8 * -math.log(0.95)))


def test_cli_human_report_with_an_aligned_table(capsys):
    out = run_cli(
        capsys, "--failures-per-day", "8.6", "--days", "54", "--save-stall", "10s",
        "--restart", "5m", "--interval", "2h", "--step-time", "1.5s",
    )
    assert "P(at least one failure) in 54d" in out
    assert "Young sqrt(2*S*M)" in out and "Daly (2006)" in out
    # Daly at M = 10046.5 s, S = 10 s is 441.6 s = 294 steps of 1.5 s.
    assert "= 294 steps" in out
    assert "goodput                61.0%" in out  # 7200/7210 * (1 - (3605 + 300) / 10046.5)
    table = out[out.index("  interval"):].splitlines()
    assert len(table) == 10  # header + 9 rows
    assert table[0].split() == ["interval", "steps", "lost/failure", "lost/day", "goodput"]
    # Right-aligned: every row's goodput column ends where the header's does.
    end = table[0].index("goodput") + len("goodput")
    assert all(row[end - 1] == "%" and row[end - 3] == "." for row in table[1:])
    assert "given" in table[-1] and "4800" in table[-1]  # 2 h = 4800 steps, the longest


@pytest.mark.parametrize("interval", ["2h", "30m"])
def test_cli_reproduces_the_brief_figures_with_free_saves_and_no_restart(capsys, interval):
    args = ("--failures-per-day", "8.6", "--interval", interval, "--save-stall", "0", "--restart", "0")
    expected = 1 - parse_duration(interval) / 2 / (DAY_S / 8.6)  # half an interval lost per failure
    assert json.loads(run_cli(capsys, *args, "--json"))["goodput"] == pytest.approx(expected)
    out = run_cli(capsys, *args)
    assert f"goodput                {expected:.1%}" in out
    assert "none above 0" in out and "Daly" not in out


def test_cli_table_prints_intervals_that_print_alike_once(capsys):
    # S = 1 ms, M = 1 day: Young's 13.1453 s and Daly's 13.1446 s both print as 13.1s.
    young, daly = young_interval(0.001, DAY_S), daly_interval(0.001, DAY_S)
    assert young != daly and f"{young:.3g}" == f"{daly:.3g}"
    out = run_cli(capsys, "--mtbf-hours", "24", "--save-stall", "1ms")
    table = out[out.index("  interval"):].splitlines()[1:]
    labelled = [row for row in table if "Young" in row or "Daly" in row]
    assert len(labelled) == 1 and labelled[0].endswith("Daly (optimal), Young")
    assert len({row.split()[0] for row in table}) == len(table) == 7  # one row per factor, none twice


def test_cli_report_without_save_stall_says_what_to_pass(capsys):
    out = run_cli(capsys, "--mtbf-hours", "3")
    assert "pass --days" in out and "pass --save-stall" in out
    assert "interval  " not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "one of the arguments --annual-failure-rate --failures-per-day --mtbf-hours is"),
        (("--mtbf-hours", "3", "--failures-per-day", "2"), "not allowed with argument"),
        (("--annual-failure-rate", "0.05"), "--annual-failure-rate needs --gpus"),
        (("--mtbf-hours", "3", "--gpus", "8"), "--gpus only applies with --annual-failure-rate"),
        (("--gpus", "8", "--annual-failure-rate", "5"), "between 0 and 1"),
        (("--gpus", "0", "--annual-failure-rate", "5%"), "--gpus: must be >= 1"),
        (("--mtbf-hours", "-3"), "--mtbf-hours: must be > 0"),
        (("--mtbf-hours", "3", "--days", "-1"), "--days: must be > 0"),
        (("--mtbf-hours", "3", "--restart=-5s"), "invalid duration '-5s'"),
        (("--mtbf-hours", "3", "--interval", "0"), "--interval: must be > 0"),
        (("--mtbf-hours", "3", "--save-stall=-1s"), "invalid duration '-1s'"),
        (("--mtbf-hours", "3", "--interval", "5 minutes"), "invalid duration '5 minutes'"),
    ],
)
def test_cli_bad_input_is_a_usage_error_naming_the_problem(capsys, args, message):
    assert message in cli_error(capsys, *args)
