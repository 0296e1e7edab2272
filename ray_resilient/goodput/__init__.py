"""Goodput: plan the checkpoint interval from failure rates and checkpoint costs."""

from ray_resilient.goodput.planner import (
    FailureStats,
    IntervalRow,
    MeasuredInputs,
    Plan,
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

__all__ = [
    "FailureStats",
    "IntervalRow",
    "MeasuredInputs",
    "Plan",
    "daly_interval",
    "expected_goodput",
    "expected_lost_per_failure",
    "failure_stats",
    "interval_steps_for",
    "make_plan",
    "mtbf_from_annual_failure_rate",
    "parse_duration",
    "plan_from_measured",
    "young_interval",
]
