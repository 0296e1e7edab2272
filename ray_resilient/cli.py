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
    MTBF_RANGE_S,
    SECONDS_PER_DAY,
    SECONDS_PER_YEAR,
    MeasuredInputs,
    measured_inputs,
    mtbf_from_annual_failure_rate,
    parse_duration,
    plan_from_measured,
)
from ray_resilient.goodput.report import format_plan


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141


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
    _add_status(commands)
    return parser


def _add_status(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "status", help="a run's checkpoints, attempts and goodput so far, and what a restart would load",
        description="Where a run stands, read from its directory alone (no Ray): each checkpoint (complete "
        "or partial, step, attempt, size, whether Ray registered it, whether its shards verify), each "
        "attempt (world size, where it resumed, how it ended), the goodput so far and the checkpoint a "
        "restart would load.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="<storage_path>/<run name>: a path or URI (s3://...)")
    parser.add_argument("--verify", choices=("none", "newest", "all"), default="newest",
                        help="which complete checkpoints to verify (shard checksums, .metadata, train state): "
                        "what a restart would try, newest first until one verifies (default), every one "
                        "(in parallel), or none")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=functools.partial(_status, parser))


def _status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ray_resilient.status import format_status, run_status

    try:
        status = run_status(args.run_dir, verify=args.verify)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    print(json.dumps(dataclasses.asdict(status), indent=2) if args.json else format_status(status))
    return 0


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
        "--save-stall", type=_duration, metavar="S",
        help="training stall per checkpoint (0: free saves, the idealized model)"
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
        "--save-interference",
        type=_duration,
        metavar="X",
        help="what a save's background write costs the steps beside it, beyond their usual time "
        "(counted with the stall as a save's cost); default: the run's with --from-run, else 0",
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
    low, high = MTBF_RANGE_S
    if not low <= mtbf_s <= high:
        parser.error(f"the job's mean time between failures would be {mtbf_s:.3g} s ({source}): a plan needs "
                     f"{low:g} s to {high / SECONDS_PER_YEAR:g} years; check the failure rate")

    costs = MeasuredInputs(save_stall_s=None, restart_s=None, step_s=None)
    if args.from_run is not None:
        try:
            costs = measured_inputs(args.from_run)
        except (OSError, ValueError) as error:
            parser.error(f"--from-run {args.from_run}: {error}")
    given = {"save_stall_s": args.save_stall, "restart_s": args.restart, "step_s": args.step_time,
             "durable_latency_s": args.durable_latency, "save_interference_s": args.save_interference}
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
            "Print the goodput breakdown of a run from its ledger (productive, slow steps, wasted, data wait, "
            "save stall, restore, hang, init restart, other) and draw its timeline as a PNG."
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
    parser.add_argument(
        "--reference-step-seconds", type=float, metavar="S",
        help="measure slow steps against this step time (e.g. another mode's) instead of the run's own best "
             "steady stretch",
    )
    parser.set_defaults(run=functools.partial(_goodput_report, parser))


def _goodput_report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ray_resilient.goodput.ledger import load_ledger
    from ray_resilient.goodput.report import draw_timeline, format_report

    run_name = os.path.basename(args.run_dir.rstrip("/"))
    png = args.png or (None if args.json else f"goodput-{run_name}.png")
    try:
        ledger = load_ledger(args.run_dir)
        breakdown = ledger.account(reference_step_seconds=args.reference_step_seconds)
        if png is not None:
            draw_timeline(ledger, breakdown, png, title=run_name)
    except ValueError as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(f"{args.run_dir}: {error}")

    if args.json:
        print(json.dumps(breakdown.summary() | {"shares": breakdown.shares()}, indent=2))
        if png is not None:
            print(f"timeline: {png}", file=sys.stderr)
    else:
        print(format_report(args.run_dir, breakdown, ledger.hangs))
        print(f"\ntimeline: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
