"""Plan a checkpoint interval from a failure rate and the cost of a checkpoint.

The model (first order, all times in seconds of wall clock):

- **Failures.** The job fails as a Poisson process with mean time between failures ``M``. For ``N``
  GPUs failing independently, each with probability ``P`` within a year, we take each GPU's time to
  failure as exponential with that annual probability: per-GPU rate ``-ln(1 - P) / 8760 h``, job
  rate ``N`` times that, ``M`` = 1 / job rate. (The usual shortcut ``P / 8760 h`` is the first-order
  approximation of it; they differ by under 3% for ``P`` up to 5%, and ours stays meaningful for
  large ``P``.) Over a run of length ``T``: P(at least one failure) = ``1 - exp(-T/M)``, expected
  failures = ``T/M``.
- **Cost of checkpointing.** A checkpoint after every ``I`` seconds of useful work costs ``S``
  seconds: the loop's stall while it stages the save, plus its interference, what the steps that
  run beside its background write take beyond their usual time (the write competes with them for
  memory bandwidth, CPU and network: measured in a run's ledger, 14% of a run's time where saves
  came every few steps). One cycle takes ``I + S`` of wall clock.
- **Cost of a failure.** A failure lands uniformly within a cycle, so it loses on average
  ``(I + S) / 2`` since the last checkpoint, plus ``R`` to restart (rescheduling, process start and
  restore: include restore time in ``R``), plus ``L``, the durable latency: a checkpoint still being
  uploaded when the failure hits is not durable, so recovery falls back one cycle further; that
  happens with probability ``L / (I + S)`` and costs a cycle, i.e. ``L`` on average.
- **Goodput**, the share of wall clock spent on progress that is kept::

      G(I) = I / (I + S) * max(0, 1 - ((I + S) / 2 + R + L) / M)

  With ``S = R = L = 0`` this is the brief's rule of thumb: each failure loses half an interval.

What it ignores: failures during a restart or during the rework after one (Daly's interval accounts
for them, ``G`` does not), failures correlated across GPUs (a node or switch taking many GPUs down
at once: pass a measured job-level failure rate instead), non-exponential failure laws (infant
mortality, wear-out), variance of the save stall, ``L`` longer than a cycle, the one-off job start
(measured inputs count it as one more restart instead) and data-loading stalls (the goodput
ledger measures those).

**Optimal interval.** Young (1974): ``sqrt(2 S M)``. Daly (2006), higher order: for ``S < 2M``,
``sqrt(2 S M) * (1 + sqrt(S / 2M) / 3 + (S / 2M) / 9) - S``, else ``M``. ``G`` itself peaks at
``sqrt(2 S (M - R - L)) - S``; for ``S, R, L`` much smaller than ``M`` these differ by a relative
``sqrt(S / 2M)`` or so and ``G`` is flat near its maximum. We recommend Daly's, the established
estimate. With ``S = 0`` (free saves, the idealized model) there is no optimum above 0: ``G`` only
grows as the interval shrinks, so the advice is to save as often as saves can become durable.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from statistics import mean, median

import numpy as np

from ray_resilient.goodput.ledger import load_ledger

SECONDS_PER_DAY = 86400.0
SECONDS_PER_YEAR = 365 * SECONDS_PER_DAY
MTBF_RANGE_S = (1.0, 1000 * SECONDS_PER_YEAR)  # the job MTBFs a plan is made for

DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": SECONDS_PER_DAY}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")

# The table of intervals spans the optimum times these factors (log-spaced, 1/8x to 8x).
TABLE_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a non-negative number with an optional unit (``30s``, ``5m``, ``1.5h``,
    ``1d``, ``250ms``); a plain number is seconds."""
    match = _DURATION_RE.match(text)
    if match is None:
        units = ", ".join(DURATION_UNITS)
        raise ValueError(
            f"invalid duration {text!r}: expected a non-negative number with an optional unit "
            f"({units}; a plain number is seconds), e.g. 30s, 5m, 1.5h, 1d"
        )
    return float(match.group(1)) * DURATION_UNITS[match.group(2) or "s"]


def _require(name: str, value: float, *, positive: bool) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")


def mtbf_from_annual_failure_rate(gpus: int, rate: float) -> float:
    """The job's mean time between failures (s) for ``gpus`` GPUs that each fail independently
    with probability ``rate`` (0 < rate < 1) within a year, exponentially distributed."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus!r}")
    if not 0 < rate < 1:
        raise ValueError(f"the annual failure rate must be strictly between 0 and 1, got {rate!r}")
    per_gpu_rate = -math.log1p(-rate) / SECONDS_PER_YEAR
    return 1.0 / (gpus * per_gpu_rate)


@dataclass(frozen=True)
class FailureStats:
    """What failures at a mean time between failures do to a run of a given length."""

    p_any_failure: float
    expected_failures: float


def failure_stats(mtbf_s: float, run_s: float) -> FailureStats:
    """P(at least one failure) and the expected number of failures over ``run_s`` seconds."""
    _require("mtbf_s", mtbf_s, positive=True)
    _require("run_s", run_s, positive=False)
    expected = run_s / mtbf_s
    return FailureStats(p_any_failure=-math.expm1(-expected), expected_failures=expected)


def expected_lost_per_failure(
    interval_s: float, save_stall_s: float, restart_s: float, durable_latency_s: float = 0.0
) -> float:
    """Seconds lost per failure: half a cycle of ``interval_s + save_stall_s``, the restart and
    the durable latency."""
    _require("interval_s", interval_s, positive=True)
    _require("save_stall_s", save_stall_s, positive=False)
    _require("restart_s", restart_s, positive=False)
    _require("durable_latency_s", durable_latency_s, positive=False)
    return (interval_s + save_stall_s) / 2 + restart_s + durable_latency_s


def expected_goodput(
    interval_s: float,
    save_stall_s: float,
    restart_s: float,
    mtbf_s: float,
    durable_latency_s: float = 0.0,
) -> float:
    """The expected share of wall clock spent on kept progress (0 to 1): ``G(I)`` of the module."""
    _require("mtbf_s", mtbf_s, positive=True)
    lost = expected_lost_per_failure(interval_s, save_stall_s, restart_s, durable_latency_s)
    return interval_s / (interval_s + save_stall_s) * max(0.0, 1.0 - lost / mtbf_s)


def young_interval(save_stall_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval (s): ``sqrt(2 S M)`` (0 for free saves: no optimum above 0)."""
    _require("save_stall_s", save_stall_s, positive=False)
    _require("mtbf_s", mtbf_s, positive=True)
    return math.sqrt(2 * save_stall_s * mtbf_s)


def daly_interval(save_stall_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimal checkpoint interval (s) of useful work (0 for free saves)."""
    _require("save_stall_s", save_stall_s, positive=False)
    _require("mtbf_s", mtbf_s, positive=True)
    if save_stall_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_stall_s / (2 * mtbf_s)
    return math.sqrt(2 * save_stall_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_stall_s


def interval_steps_for(mtbf_s: float, save_stall_s: float, step_s: float, durable_s: float = 0.0) -> int:
    """Daly's interval in whole training steps of ``step_s`` seconds (at least 1), and never
    shorter than ``durable_s``, the time a save takes to become durable: saves are written one
    after another, so a shorter interval would only defer saves."""
    _require("step_s", step_s, positive=True)
    return max(1, round(daly_interval(save_stall_s, mtbf_s) / step_s), math.ceil(durable_s / step_s))


@dataclass(frozen=True)
class MeasuredInputs:
    """Costs measured by a run (its goodput ledger); None where the run did not measure one
    (e.g. ``restart_s`` of a run that never restarted)."""

    save_stall_s: float | None
    restart_s: float | None
    step_s: float | None
    durable_latency_s: float | None = None
    save_interference_s: float | None = None


@dataclass(frozen=True)
class IntervalRow:
    """The planner's estimate at one checkpoint interval; ``label`` names why it is listed."""

    interval_s: float
    lost_per_failure_s: float
    lost_per_day_s: float
    goodput: float
    label: str


@dataclass(frozen=True)
class Plan:
    """Inputs and estimates of one planning question; None where an input it needs is missing:
    the run length for the failure counts, the save stall for the optimal intervals and the
    table, the interval (and save stall) for the estimates at that interval, the step time for
    steps. A save stall of 0 has no optimal interval above 0 (``daly_interval_s`` is 0,
    ``optimal_goodput`` None): the table then spans the given interval, and the recommendation
    is the shortest interval saves allow (one step, or the durable latency), if one is known."""

    mtbf_s: float
    failures_per_day: float
    run_s: float | None
    save_stall_s: float | None
    save_interference_s: float
    restart_s: float
    durable_latency_s: float
    interval_s: float | None
    step_s: float | None
    p_any_failure: float | None
    expected_failures: float | None
    young_interval_s: float | None
    daly_interval_s: float | None
    optimal_goodput: float | None
    recommended_interval_s: float | None
    recommended_interval_steps: int | None
    lost_per_failure_s: float | None
    lost_per_day_s: float | None
    goodput: float | None
    table: tuple[IntervalRow, ...]


def make_plan(
    mtbf_s: float,
    *,
    run_s: float | None = None,
    save_stall_s: float | None = None,
    restart_s: float = 0.0,
    interval_s: float | None = None,
    step_s: float | None = None,
    durable_latency_s: float = 0.0,
    save_interference_s: float = 0.0,
) -> Plan:
    """Everything the model says about a job with mean time between failures ``mtbf_s``; a save
    costs ``save_stall_s + save_interference_s`` (the model's ``S``).

    The recommended interval is Daly's, rounded to whole steps when ``step_s`` is known. The table
    lists the optimum times 1/8 to 8, Young's interval and ``interval_s``, shortest first; with
    free saves (``save_stall_s=0``) it lists ``interval_s`` times 1/8 to 8 instead.
    """
    _require("mtbf_s", mtbf_s, positive=True)
    _require("restart_s", restart_s, positive=False)
    _require("durable_latency_s", durable_latency_s, positive=False)
    _require("save_interference_s", save_interference_s, positive=False)
    if interval_s is not None:
        _require("interval_s", interval_s, positive=True)
    if step_s is not None:
        _require("step_s", step_s, positive=True)
    stats = failure_stats(mtbf_s, run_s) if run_s is not None else None
    save_cost = None if save_stall_s is None else save_stall_s + save_interference_s

    def row(interval: float, label: str) -> IntervalRow:
        lost = expected_lost_per_failure(interval, save_cost, restart_s, durable_latency_s)
        return IntervalRow(
            interval_s=interval,
            lost_per_failure_s=lost,
            lost_per_day_s=lost * SECONDS_PER_DAY / mtbf_s,
            goodput=expected_goodput(interval, save_cost, restart_s, mtbf_s, durable_latency_s),
            label=label,
        )

    young = daly = recommended = steps = optimal = given = None
    table: list[IntervalRow] = []
    if save_cost is not None:
        young = young_interval(save_cost, mtbf_s)
        daly = daly_interval(save_cost, mtbf_s)
        # Never shorter than a save's time to durable: saves are written one after another, so
        # a shorter interval only defers them.
        recommended = max(daly, durable_latency_s) or None  # free saves, nothing to wait for: no bound
        if step_s is not None:
            steps = interval_steps_for(mtbf_s, save_cost, step_s, durable_latency_s)
            recommended = steps * step_s
        labels: dict[float, str] = {}
        if daly > 0:
            optimal = expected_goodput(daly, save_cost, restart_s, mtbf_s, durable_latency_s)
            labels = {daly * f: "" for f in TABLE_FACTORS}
            labels[young] = "Young"
            labels[daly] = "Daly (optimal)"
        elif interval_s is not None:
            labels = {interval_s * f: "" for f in TABLE_FACTORS}
        if interval_s is not None:
            labels[interval_s] = ", ".join(filter(None, [labels.get(interval_s), "given"]))
            given = row(interval_s, "given")
        table = [row(interval, labels[interval]) for interval in sorted(labels)]

    return Plan(
        mtbf_s=mtbf_s,
        failures_per_day=SECONDS_PER_DAY / mtbf_s,
        run_s=run_s,
        save_stall_s=save_stall_s,
        save_interference_s=save_interference_s,
        restart_s=restart_s,
        durable_latency_s=durable_latency_s,
        interval_s=interval_s,
        step_s=step_s,
        p_any_failure=stats.p_any_failure if stats else None,
        expected_failures=stats.expected_failures if stats else None,
        young_interval_s=young,
        daly_interval_s=daly,
        optimal_goodput=optimal,
        recommended_interval_s=recommended,
        recommended_interval_steps=steps,
        lost_per_failure_s=given.lost_per_failure_s if given else None,
        lost_per_day_s=given.lost_per_day_s if given else None,
        goodput=given.goodput if given else None,
        table=tuple(table),
    )


def plan_from_measured(
    measured: MeasuredInputs,
    mtbf_s: float,
    *,
    run_s: float | None = None,
    interval_s: float | None = None,
) -> Plan:
    """:func:`make_plan` with the save stall and interference, restart time, step time and durable
    latency a run measured (what it did not measure, but the stall, counts as 0)."""
    return make_plan(
        mtbf_s,
        run_s=run_s,
        save_stall_s=measured.save_stall_s,
        restart_s=0.0 if measured.restart_s is None else measured.restart_s,
        interval_s=interval_s,
        step_s=measured.step_s,
        durable_latency_s=0.0 if measured.durable_latency_s is None else measured.durable_latency_s,
        save_interference_s=0.0 if measured.save_interference_s is None else measured.save_interference_s,
    )


def measured_inputs(run_dir: str) -> MeasuredInputs:
    """The planner's inputs measured by the run at ``run_dir`` (a path or URI): median save stall,
    mean restart, median kept step time, time from a save's start to durable, and the mean of what
    each save's write cost the steps beside it (the mean: the model charges each save its expected
    cost).

    The restart is the whole cost of one: from the failed attempt's last event to the restored
    attempt's first step (detection, new workers, restore). The job's first start (scheduling,
    new workers, the model built) counts as one too, so a run that never failed still says what
    a restart costs. The mean, not the median: the model charges the expected cost per failure.
    """
    breakdown = load_ledger(run_dir).account()
    return MeasuredInputs(
        save_stall_s=median(breakdown.save_stalls) if breakdown.save_stalls else None,
        restart_s=mean(breakdown.starts) if breakdown.starts else None,
        step_s=float(np.median(breakdown.kept_step_seconds.values())) if breakdown.kept_step_seconds else None,
        durable_latency_s=median(breakdown.durable_latencies) if breakdown.durable_latencies else None,
        save_interference_s=mean(interference) if (interference := breakdown.save_interference) else None,
    )
