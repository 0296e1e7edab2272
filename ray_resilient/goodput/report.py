"""Goodput as people read it: a run's breakdown as a table and a PNG timeline, and a plan as text."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from ray_resilient.goodput.accounting import PARTS, AttemptSummary, Breakdown
from ray_resilient.goodput.events import EventKind
from ray_resilient.goodput.ledger import Ledger, load_ledger
from ray_resilient.goodput.planner import SECONDS_PER_DAY, Plan

NOTES = (
    "slow steps: what kept steps took beyond the reference step (the median step of the run's best steady "
    "stretch, unless one is given)",
    "wasted: steps lost to a failure and computed again (a later attempt restored an older checkpoint, "
    "or survivors dropped the step a lost replica was in)",
    "hang: from a hung rank's last progress until the hang watchdog declared it hung",
    "init restart: from the run's start or an attempt's end to the next attempt's first work (startup, detection)",
)
# Timeline bars, drawn in this order: (category, label, colour).
BARS = (
    ("init", "init/restart", "#a0a0a0"),
    ("restore", "restore", "#1f77b4"),
    ("kept", "step (kept)", "#2ca02c"),
    ("data_wait", "data wait (kept step)", "#f2c14e"),
    ("wasted", "step (wasted)", "#d62728"),
    ("save", "save stall", "#9467bd"),
)


def render_report(run_dir: str, png_path: str | None, reference_step_seconds: float | None = None) -> str:
    """The text report of the run at ``run_dir`` (slow steps against ``reference_step_seconds``, default
    the run's own); draws its timeline to ``png_path`` if given."""
    ledger = load_ledger(run_dir)
    breakdown = ledger.account(reference_step_seconds=reference_step_seconds)
    if png_path is not None:
        draw_timeline(ledger, breakdown, png_path, title=run_dir.rstrip("/").rsplit("/", 1)[-1])
    return format_report(run_dir, breakdown, ledger.hangs)


def format_report(run_dir: str, breakdown: Breakdown, hangs: Sequence[dict[str, Any]] = ()) -> str:
    """The counts, the goodput, a table of each part's seconds and share of the total, and each
    hang the watchdog declared (``hangs``: its events)."""
    lines = [f"goodput report of {run_dir}"]
    counts = [("attempts", str(breakdown.attempts)), ("failures", str(breakdown.failures)),
              ("steps kept", str(breakdown.steps_kept)), ("steps recomputed", str(breakdown.steps_recomputed)),
              ("reference step", "-" if breakdown.reference_step_seconds is None
               else f"{breakdown.reference_step_seconds:.3f} s"), ("goodput", f"{breakdown.goodput:.1%}")]
    width = max(len(label) for label, _ in counts)
    lines += [f"  {label.ljust(width)}  {value}" for label, value in counts]
    shares = breakdown.shares()
    table = [("part", "seconds", "share")]
    table += [(part.replace("_", " "), f"{getattr(breakdown, part):.1f}", f"{shares[part]:.1%}") for part in PARTS]
    table.append(("total", f"{breakdown.total:.1f}", f"{1 if breakdown.total > 0 else 0:.1%}"))
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines.append("")
    for name, seconds, share in table:
        lines.append(f"  {name.ljust(widths[0])}  {seconds.rjust(widths[1])}  {share.rjust(widths[2])}")
    declared = hang_lines(hangs)
    if declared:
        lines += ["", *declared]
    lines += ["", *(f"  {note}" for note in NOTES)]
    return "\n".join(lines)


def hang_lines(events: Sequence[dict[str, Any]]) -> list[str]:
    """A line for each hang the watchdog declared: who, where, why, and whether its step had been
    declared before (each time doubles later attempts' allowance there)."""
    lines, at_step = [], Counter()
    for event in events:
        if event["kind"] != EventKind.HANG:
            continue
        step = event.get("step")
        at_step[step] += 1
        why = ("silent: stopped, or its node lost" if event.get("silent")
               else f"no progress in {event.get('phase', '?')!r}")
        where = "before its first step" if step is None else f"after step {step}"
        again = (f"; hang {at_step[step]} at this step: the allowance there doubled each time"
                 if step is not None and at_step[step] > 1 else "")
        lines.append(f"  hang: rank {event['hung_rank']} {where}, {why}, declared after "
                     f"{event['t'] - event['t_start']:.1f} s{again}")
    return lines


def draw_timeline(ledger: Ledger, breakdown: Breakdown, png_path: str, title: str) -> None:
    """A PNG of the run: one lane per attempt, its bars, checkpoints and failures over time."""
    attempts, job_starts = ledger.attempts, ledger.job_starts
    start = min([a.start for a in attempts[:1]] + job_starts)
    bars: list[dict[str, list[tuple[float, float]]]] = [defaultdict(list) for _ in attempts]
    marks: dict[str, list[tuple[float, int]]] = defaultdict(list)  # kind -> (seconds, lane)
    boundary = start
    for lane, attempt in enumerate(attempts):
        bars[lane]["init"].append((boundary - start, max(0.0, attempt.first_work - boundary)))
        for category, spans in attempt.bars.items():
            bars[lane][category] += [(t0 - start, seconds) for t0, seconds in spans]
        for kind, times in attempt.marks.items():
            marks[kind] += [(t - start, lane) for t in times]
        if lane + 1 < len(attempts) and not attempt.finished:
            marks["failure"].append((attempt.end - start, lane))
        boundary = attempt.end
    for t, _ in ledger.failures:  # any rank's: placed in the lane of the attempt running at the time
        if attempts:
            lane = max([i for i, a in enumerate(attempts) if a.start <= t], default=0)
            marks["failure"].append((t - start, lane))

    from matplotlib.figure import Figure  # the timeline's dependency alone
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    figure = Figure(figsize=(14, 1.8 + 0.6 * max(1, len(attempts))), dpi=120, layout="constrained")
    axes = figure.add_subplot()
    for lane, lane_bars in enumerate(bars):
        for category, _, colour in BARS:
            if lane_bars[category]:
                axes.broken_barh(lane_bars[category], (lane - 0.25, 0.5), facecolors=colour, linewidth=0)
    for kind, marker, offset, colour, size in (("durable", "^", 0.36, "#333333", 30),
                                               ("registered", "v", -0.36, "#1f77b4", 30),
                                               ("failure", "X", 0.0, "#d62728", 120),
                                               ("membership", "D", 0.0, "#ff7f0e", 40)):
        if marks[kind]:
            xs, lanes = zip(*marks[kind])
            axes.scatter(xs, [y + offset for y in lanes], marker=marker, s=size, c=colour, edgecolors="black",
                         linewidths=0.6, zorder=3)
    for t in job_starts:
        axes.axvline(t - start, color="black", linestyle="--", linewidth=1)
    axes.set_yticks(range(len(attempts)), [_lane_label(i, a) for i, a in enumerate(attempts)])
    axes.set_ylim(max(1, len(attempts)) - 0.5, -0.5)
    axes.set_xlim(0, max(breakdown.total, 1.0) * 1.01)
    axes.set_xlabel("seconds since the run's start")
    axes.grid(axis="x", alpha=0.3)
    shares = "  ".join(f"{part.replace('_', ' ')} {share:.1%}" for part, share in breakdown.shares().items())
    axes.set_title(f"{title}: goodput {breakdown.goodput:.1%}\n{shares}", fontsize=10)
    handles = [Patch(color=colour, label=label) for _, label, colour in BARS] + [
        Line2D([], [], marker="^", color="#333333", linestyle="", label="durable checkpoint"),
        Line2D([], [], marker="v", color="#1f77b4", linestyle="", label="registered checkpoint"),
        Line2D([], [], marker="X", color="#d62728", markeredgecolor="black", linestyle="", markersize=9,
               label="failure"),
        Line2D([], [], color="black", linestyle="--", label="driver start"),
        Line2D([], [], marker="D", color="#ff7f0e", linestyle="", label="replicas changed (survivor mode)"),
    ]
    figure.legend(handles=handles, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    figure.savefig(png_path)


def _lane_label(index: int, attempt: AttemptSummary) -> str:
    world_size = "?" if attempt.world_size is None else attempt.world_size
    if attempt.took_over:
        return f"attempt {index + 1}\nlead taken over, {world_size} replicas"
    start = "died before restoring" if attempt.restored_step is None else f"from step {attempt.restored_step}"
    return f"attempt {index + 1}\nworld size {world_size}, {start}"


def format_duration(seconds: float) -> str:
    """``seconds`` in the largest unit it reaches (``45s``, ``1.5h``), to 3 significant digits."""
    for unit, size in (("d", SECONDS_PER_DAY), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size:
            break
    value = seconds / size
    return f"{value:.3g}{unit}" if value < 1000 else f"{value:.0f}{unit}"


def format_plan(plan: Plan, source: str) -> str:
    """A human-readable report of ``plan``; ``source`` says where the failure rate came from."""
    failures = [
        ("job MTBF", f"{format_duration(plan.mtbf_s)}  ({source})"),
        ("failures per day", f"{plan.failures_per_day:.3g}"),
    ]
    if plan.run_s is not None:
        days = format_duration(plan.run_s)
        failures += [
            (f"P(at least one failure) in {days}", f"{plan.p_any_failure:.1%}"),
            (f"expected failures in {days}", f"{plan.expected_failures:.3g}"),
        ]
    lines = ["Failures", *_rows(*failures)]
    if plan.run_s is None:
        lines.append("  (pass --days for the failures over the run)")

    def known(seconds: float | None) -> str:
        return "unknown" if seconds is None else format_duration(seconds)

    lines += ["", "Costs"]
    lines += _rows(
        ("save stall", known(plan.save_stall_s)),
        ("save interference", format_duration(plan.save_interference_s)),
        ("restart", format_duration(plan.restart_s)),
        ("durable latency", format_duration(plan.durable_latency_s)),
        ("step time", known(plan.step_s)),
    )
    if plan.save_stall_s is None:
        lines += ["", "(pass --save-stall or --from-run for the optimal interval and goodput)"]
        return "\n".join(lines)

    steps = plan.recommended_interval_steps
    recommended = "every step" if plan.recommended_interval_s is None else \
        format_duration(plan.recommended_interval_s)
    if steps is not None:
        recommended += f" = {steps} step{'s' if steps != 1 else ''}"
    lines += ["", "Optimal interval"]
    if plan.optimal_goodput is None:
        lines += ["  none above 0: with free saves goodput only grows as the interval shrinks,",
                  "  so save as often as saves become durable",
                  *_rows(("recommended", recommended))]
    else:
        lines += _rows(
            ("Young sqrt(2*S*M)", format_duration(plan.young_interval_s)),
            ("Daly (2006)", format_duration(plan.daly_interval_s)),
            ("goodput at Daly's", f"{plan.optimal_goodput:.1%}"),
            ("recommended", recommended),
        )
    if plan.interval_s is not None:
        lines += ["", f"At the given interval ({format_duration(plan.interval_s)})"]
        lines += _rows(
            ("lost work per failure", format_duration(plan.lost_per_failure_s)),
            ("lost work per day", format_duration(plan.lost_per_day_s)),
            ("goodput", f"{plan.goodput:.1%}"),
        )

    if not plan.table:
        lines += ["", "(pass --interval for a table of intervals around it)"]
        return "\n".join(lines)
    steps = plan.step_s is not None
    table = [["interval", *(["steps"] if steps else []), "lost/failure", "lost/day", "goodput", ""]]
    for row in plan.table:
        cells = [
            format_duration(row.interval_s),
            *([f"{row.interval_s / plan.step_s:.0f}"] if steps else []),
            format_duration(row.lost_per_failure_s),
            format_duration(row.lost_per_day_s),
            f"{row.goodput:.1%}",
            row.label,
        ]
        if cells[:-1] == table[-1][:-1]:  # two intervals that print alike (Young's and Daly's): one row
            table[-1][-1] = ", ".join(filter(None, [table[-1][-1], row.label]))
        else:
            table.append(cells)
    widths = [max(len(cells[i]) for cells in table) for i in range(len(table[0]))]
    lines.append("")
    for cells in table:
        numbers = [cell.rjust(width) for cell, width in zip(cells[:-1], widths)]
        lines.append("  " + "  ".join([*numbers, cells[-1]]).rstrip())
    return "\n".join(lines)


def _rows(*pairs: tuple[str, str]) -> list[str]:
    """``label  value`` lines with the values aligned."""
    width = max(len(label) for label, _ in pairs)
    return [f"  {label.ljust(width)}  {value}" for label, value in pairs]
