"""The ``ray-resilient`` command line.

``ray-resilient goodput plan`` estimates failures, lost work and goodput, and recommends a
checkpoint interval (see :mod:`ray_resilient.goodput.planner` for the model); ``ray-resilient
goodput report`` prints where a run's time went and draws its timeline. Each subcommand is
added to the parser by one ``_add_*`` function that also sets the function it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

from ray_resilient.goodput.planner import (
    SECONDS_PER_DAY,
    MeasuredInputs,
    Plan,
    mtbf_from_annual_failure_rate,
    parse_duration,
    plan_from_measured,
)


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``ray-resilient`` parser with all its subcommands."""
    parser = argparse.ArgumentParser(
        prog="ray-resilient", description="Fast, fault-tolerant PyTorch training on Ray Train."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    goodput = commands.add_parser(
        "goodput", help="report a run's goodput, plan the checkpoint interval",
        description="Goodput: a run's breakdown from its ledger, and the checkpoint-interval planner."
    )
    goodput_commands = goodput.add_subparsers(
        dest="goodput_command", metavar="SUBCOMMAND", required=True
    )
    _add_goodput_plan(goodput_commands)
    _add_goodput_report(goodput_commands)
    return parser


# Argument types: argparse reports an ArgumentTypeError's message as is.


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_duration(text: str) -> float:
    seconds = _duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return seconds


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _probability(text: str) -> float:
    """A probability as a fraction (``0.05``) or a percentage (``5%``), strictly between 0 and 1."""
    percent = text.strip().endswith("%")
    try:
        value = float(text.strip().removesuffix("%")) / (100 if percent else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a probability: {text!r} (e.g. 0.05 or 5%)") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(
            f"must be between 0 and 1 exclusive (a fraction like 0.05, or 5%), got {text!r}"
        )
    return value


def _add_goodput_plan(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="estimate failures, lost work and goodput; recommend a checkpoint interval",
        description=(
            "Estimate failures, lost work and goodput, and recommend a checkpoint interval "
            "(Young's and Daly's). Durations take a unit: 250ms, 30s, 5m, 1.5h, 1d; a plain "
            "number is seconds."
        ),
    )
    rate = parser.add_argument_group("failure rate (exactly one of)")
    exclusive = rate.add_mutually_exclusive_group(required=True)
    exclusive.add_argument(
        "--annual-failure-rate",
        type=_probability,
        metavar="P",
        help="probability that one GPU fails within a year (0.05 or 5%%), independent and "
        "exponential; needs --gpus",
    )
    exclusive.add_argument(
        "--failures-per-day", type=_positive_number, metavar="F", help="failures of the whole job"
    )
    exclusive.add_argument(
        "--mtbf-hours",
        type=_positive_number,
        metavar="M",
        help="the whole job's mean time between failures, in hours",
    )
    rate.add_argument("--gpus", type=_positive_int, metavar="N", help="GPUs in the job")

    costs = parser.add_argument_group("the run and its costs")
    costs.add_argument(
        "--days", type=_positive_number, metavar="D", help="length of the run in days"
    )
    costs.add_argument(
        "--from-run",
        metavar="RUN_DIR",
        help="take the save stall, restart time and step time measured by this run's goodput "
        "ledger; the options below override them",
    )
    costs.add_argument(
        "--save-stall", type=_positive_duration, metavar="S", help="training stall per checkpoint"
    )
    costs.add_argument(
        "--restart",
        type=_duration,
        metavar="R",
        help="time from a failure to training again, restore included (default 0)",
    )
    costs.add_argument(
        "--step-time", type=_positive_duration, metavar="T", help="time of one training step"
    )
    costs.add_argument(
        "--durable-latency",
        type=_duration,
        metavar="L",
        help="time from a checkpoint's save until it is durable (async write and upload; the "
        "recommended interval is never shorter); default: the run's with --from-run, else 0",
    )
    costs.add_argument(
        "--interval", type=_positive_duration, metavar="I", help="checkpoint interval to evaluate"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=functools.partial(_goodput_plan, parser))


def _goodput_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.annual_failure_rate is not None:
        if args.gpus is None:
            parser.error("--annual-failure-rate needs --gpus")
        mtbf_s = mtbf_from_annual_failure_rate(args.gpus, args.annual_failure_rate)
        source = f"{args.gpus} GPUs, each failing with probability {args.annual_failure_rate:.3g}"
        source += " a year"
    elif args.gpus is not None:
        parser.error("--gpus only applies with --annual-failure-rate")
    elif args.failures_per_day is not None:
        mtbf_s = SECONDS_PER_DAY / args.failures_per_day
        source = f"{args.failures_per_day:g} failures a day"
    else:
        mtbf_s = args.mtbf_hours * 3600
        source = "as given"

    costs = MeasuredInputs(save_stall_s=None, restart_s=None, step_s=None, durable_latency_s=None)
    if args.from_run is not None:
        from ray_resilient.goodput.ledger import measured_inputs

        try:
            costs = measured_inputs(args.from_run)
        except (OSError, ValueError) as error:
            parser.error(f"--from-run {args.from_run}: {error}")
    given = {"save_stall_s": args.save_stall, "restart_s": args.restart, "step_s": args.step_time,
             "durable_latency_s": args.durable_latency}
    costs = dataclasses.replace(costs, **{k: v for k, v in given.items() if v is not None})
    try:
        plan = plan_from_measured(
            costs,
            mtbf_s,
            run_s=None if args.days is None else args.days * SECONDS_PER_DAY,
            interval_s=args.interval,
        )
    except ValueError as error:
        parser.error(str(error))

    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=2))
    else:
        print(format_plan(plan, source))
    return 0


def _add_goodput_report(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "report",
        help="where a run's time went: its goodput breakdown, and a PNG timeline",
        description=(
            "Print the goodput breakdown of a run from its ledger (productive, wasted, data wait, "
            "save stall, restore, init restart, other) and draw its timeline as a PNG."
        ),
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="the run directory <storage_path>/<run name> (path or URI)"
    )
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="where to draw the timeline (default ./goodput-<run name>.png; with --json, none)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the breakdown and its shares as one JSON object"
    )
    parser.set_defaults(run=functools.partial(_goodput_report, parser))


def _goodput_report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ray_resilient.goodput.accounting import account
    from ray_resilient.goodput.ledger import load_events
    from ray_resilient.goodput.report import draw_timeline, format_report

    run_name = os.path.basename(args.run_dir.rstrip("/"))
    png = args.png or (None if args.json else f"goodput-{run_name}.png")
    try:
        events = load_events(args.run_dir)
        breakdown = account(events)
        if png is not None:
            draw_timeline(events, breakdown, png, title=run_name)
    except ValueError as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(f"{args.run_dir}: {error}")

    if args.json:
        print(json.dumps(breakdown.summary() | {"shares": breakdown.shares()}, indent=2))
        if png is not None:
            print(f"timeline: {png}", file=sys.stderr)
    else:
        print(format_report(args.run_dir, breakdown))
        print(f"\ntimeline: {png}")
    return 0


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
        ("restart", format_duration(plan.restart_s)),
        ("durable latency", format_duration(plan.durable_latency_s)),
        ("step time", known(plan.step_s)),
    )
    if plan.save_stall_s is None:
        lines += ["", "(pass --save-stall or --from-run for the optimal interval and goodput)"]
        return "\n".join(lines)

    recommended = format_duration(plan.recommended_interval_s)
    if plan.recommended_interval_steps is not None:
        recommended += f" = {plan.recommended_interval_steps} steps"
    lines += ["", "Optimal interval"]
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

    steps = plan.step_s is not None
    table = [["interval", *(["steps"] if steps else []), "lost/failure", "lost/day", "goodput", ""]]
    for row in plan.table:
        table.append([
            format_duration(row.interval_s),
            *([f"{row.interval_s / plan.step_s:.0f}"] if steps else []),
            format_duration(row.lost_per_failure_s),
            format_duration(row.lost_per_day_s),
            f"{row.goodput:.1%}",
            row.label,
        ])
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


if __name__ == "__main__":
    sys.exit(main())
