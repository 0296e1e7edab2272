"""Goodput: a ledger of every second of a run across restarts, and a planner for the checkpoint interval."""

from ray_resilient.goodput.accounting import Breakdown, account
from ray_resilient.goodput.ledger import LedgerWriter, measured_inputs, read_events
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
    "Breakdown",
    "LedgerWriter",
    "account",
    "measured_inputs",
    "read_events",
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
