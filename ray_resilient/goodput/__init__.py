"""Goodput: a ledger of every second of a run across restarts, and a planner for the checkpoint interval.

The names in ``__all__`` are the public API; the modules behind them are internal and may change.
"""

from ray_resilient._lazy import lazy_exports

_EXPORTS = {
    "Breakdown": "accounting",
    "account": "accounting",
    "EventKind": "events",
    "load_events": "ledger",
    "read_events": "ledger",
    "MeasuredInputs": "planner",
    "Plan": "planner",
    "daly_interval": "planner",
    "interval_steps_for": "planner",
    "make_plan": "planner",
    "measured_inputs": "planner",
    "parse_duration": "planner",
    "plan_from_measured": "planner",
    "young_interval": "planner",
    "render_report": "report",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
