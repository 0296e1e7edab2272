"""Goodput: a ledger of every second of a run across restarts, and a planner for the checkpoint interval.

The names in ``__all__`` are the stable API, those in ``DEVELOPER`` the developer API; the modules
behind them are internal and may change.
A run's ledger is written by :class:`LedgerWriter` (the ``Checkpointer`` keeps one; a loop of
your own can too) and read by :func:`load_ledger`: a :class:`Ledger` of each attempt's
:class:`AttemptSummary`, accounted by its ``account()`` into a :class:`Breakdown` of the parts in
``PARTS``; a restore stores the summaries of the attempts that ended (:func:`store_summaries`),
so that readers skip their events. Every raw event is read by :func:`load_events`, split into
attempts by :func:`group_attempts` and accounted the same by :func:`account`.
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.goodput.accounting import PARTS, Attempt, AttemptSummary, Breakdown, account, group_attempts
    from ray_resilient.goodput.events import EventKind
    from ray_resilient.goodput.ledger import (
        Ledger, LedgerWriter, load_events, load_ledger, read_events, read_ledger, store_summaries,
    )
    from ray_resilient.goodput.planner import (
        MeasuredInputs, Plan, daly_interval, expected_goodput, interval_steps_for, make_plan, measured_inputs,
        parse_duration, plan_from_measured, young_interval,
    )
    from ray_resilient.goodput.report import render_report

_EXPORTS = {
    "PARTS": "accounting",
    "AttemptSummary": "accounting",
    "Breakdown": "accounting",
    "EventKind": "events",
    "Ledger": "ledger",
    "load_events": "ledger",
    "load_ledger": "ledger",
    "read_events": "ledger",
    "read_ledger": "ledger",
    "MeasuredInputs": "planner",
    "Plan": "planner",
    "make_plan": "planner",
    "measured_inputs": "planner",
    "parse_duration": "planner",
    "plan_from_measured": "planner",
    "render_report": "report",
}
DEVELOPER = {  # for code that extends the library: may change between minor versions
    "Attempt": "accounting",
    "account": "accounting",
    "group_attempts": "accounting",
    "LedgerWriter": "ledger",
    "store_summaries": "ledger",
    "daly_interval": "planner",
    "expected_goodput": "planner",
    "interval_steps_for": "planner",
    "young_interval": "planner",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS | DEVELOPER)
