"""Hang recovery of the main job, and its false alarms: a stopped worker found and replaced in
seconds; no healthy rank ever killed.

Setup
    The README's main job, ``jobs/train_images.py``, as a user runs it (a Ray instance of its own,
    a local run directory and MLflow store, in a scratch directory): ResNet-18 on the embedded
    dataset (``--per-class`` images of each of 4 classes, 32x32), 2 workers (``--min-workers`` and
    ``--max-workers`` 2), DDP, a checkpoint every ``--interval`` steps, the hang watchdog at its
    defaults (``HangWatchdogConfig``: a rank silent for 2 s, or 4 x the p99 of the run's heartbeat
    gaps, is stopped; one that answers but makes no progress is hung after ``max(60 s, 10 x`` the
    p99 of its recent steps' longest stretch without progress``)``). Runs of the same length, one
    after the other (faults from ``ray_resilient.faults``):

    stopped        rank 1 stops itself with SIGSTOP right after a seeded step (``stop:step=N:rank=1``,
                   N drawn from ``--seed`` in the middle half of the run): a hang without dying, its
                   sockets open. Rank 0 waits in the next all-reduce.

    The false-alarm suite: none of these is a hang, and each must run to its end with none declared.

    slow saves     every checkpoint's write on rank 1 takes ``--slow-write`` seconds more
                   (``slow_write:upload=S:rank=1:seconds=X``): slow saves, the final one waited for.
    killed         rank 1 SIGKILLed after a step (``kill:step=N:rank=1``; the README's demo): rank 0
                   waits for the dead rank in its collectives until Ray restarts the group.
    preemption     a preemption notice after step P (not a checkpoint step) on both ranks, and the
                   just-in-time save's write on rank 1 takes 30 s more: every rank waits for it to
                   be durable, making no progress.
    fixed pause    rank 1 pauses 8 s without progress after step Q in every attempt, and rank 0 is
                   killed 3 steps later: the restarted attempt passes step Q again.
    validation     rank 0 alone spends 45 s without progress after an epoch's last step (a long
                   evaluation that reports nothing); rank 1 waits for it.
    slow restore   rank 1's restore pauses 20 s in every attempt, and rank 1 is killed once: the
                   second attempt restores a real checkpoint, slowly.
    beside another two clean runs at the same time on the same cores.

Measurement (from the runs' goodput ledgers)
    stop                  rank 0's record of step N (the ranks finish a step together in DDP's
                          all-reduce; rank 1 stops right after it).
    hang_detect_seconds   stop -> the watchdog's ``hang`` event (the attempt declared failed, the
                          hung process about to be killed).
    hang_recover_seconds  stop -> the first step of the new attempt (rank 0's record: only rank 0
                          records steps, and the ranks finish a step together).
    false_alarms          ``hang`` events in the false-alarm suite's runs (and runs that failed).

    The alternative without the watchdog is Ray's worker health check: a live worker that does
    not answer is replaced after ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S`` (600 s in Ray, 60 s
    in ``recommended_ray_config``); the ratio printed is against the recommended 60 s.

The last line::

    hang_detect_seconds=<s> hang_recover_seconds=<s> false_alarms=<n> false_alarm_scenarios=<n>

Results: ``docs/benchmarks.md``. Run: ``python benchmarks/hang_recovery.py`` (about 20 minutes;
``--only stopped,killed`` runs some).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from ray_resilient.goodput import read_events
from ray_resilient.testing.kit import experiment_dir

JOB = Path(__file__).resolve().parent.parent / "jobs" / "train_images.py"
CLASSES = 4
GLOBAL_BATCH = 64  # the job's default
HEALTH_CHECK_TIMEOUT_S = 60.0  # recommended_ray_config's RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S


def start_job(root: Path, name: str, faults: str, args: argparse.Namespace) -> subprocess.Popen:
    """Start the main job in ``root`` under ``name`` with ``faults`` (its log: ``<name>.log``)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow-{name}.db"
    command = [sys.executable, str(JOB), "--per-class", str(args.per_class), "--epochs", str(args.epochs),
               "--interval", str(args.interval), "--min-workers", "2", "--max-workers", "2",
               "--storage-path", str(root / "runs"), "--name", name, "--faults", faults]
    with open(root / f"{name}.log", "w") as log:
        return subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def finished(root: Path, name: str, job: subprocess.Popen, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The ledger's events of a job that ran to its end, else None (its log says why)."""
    try:
        code = job.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        code = None
    if code != 0:
        print(f"  the {name} run failed ({code}); see {root / f'{name}.log'} (--keep keeps it)")
        return None
    return read_events(pafs.LocalFileSystem(), str(root / "runs" / name))


def hang_timings(events: list[dict[str, Any]], stop_step: int) -> tuple[float, float]:
    """(stop -> hang declared, stop -> the new attempt's first step), in seconds."""
    hangs = [e for e in events if e["kind"] == "hang"]
    if len(hangs) != 1:
        raise SystemExit(f"expected one hang declared in the stopped run, found {len(hangs)}: {hangs}")
    hang = hangs[0]
    steps = [e for e in events if e["kind"] == "step" and e["rank"] == 0]
    stop = next(e["t"] for e in steps if e["step"] == stop_step and e["t"] < hang["t"])
    first_after = min(e["t"] for e in steps if e["t"] > hang["t"])
    return hang["t"] - stop, first_after - stop


def evidence(events: list[dict[str, Any]]) -> str:
    """What a run went through: its attempts and the longest time between two of rank 0's steps
    (the pause, the slow save or restore the scenario put there)."""
    attempts = sum(e["kind"] == "attempt_start" and e["rank"] == 0 for e in events)
    steps = sorted(e["t"] for e in events if e["kind"] == "step" and e["rank"] == 0)
    longest = max((b - a for a, b in zip(steps, steps[1:])), default=0.0)
    return f"{attempts} attempt(s), {len(steps)} steps, at most {longest:.1f} s between two steps"


def false_alarm_plans(steps: int, args: argparse.Namespace) -> dict[str, list[str]]:
    """Each scenario of the false-alarm suite: the fault plans of the runs it starts at once."""
    per_epoch = steps // args.epochs
    middle = steps // 2
    preempt = middle + args.interval // 2  # not a checkpoint step: the just-in-time save is its own
    slow = ";".join(f"slow_write:upload={s}:rank=1:seconds={args.slow_write}"
                    for s in range(args.interval, steps, args.interval))
    return {
        "slow saves": [slow],
        "killed": [f"kill:step={middle}:rank=1"],
        "preemption": [f"preempt:step={preempt}:rank=0;preempt:step={preempt}:rank=1;"
                       f"slow_write:upload={preempt}:rank=1:seconds=30"],
        "fixed pause": [f"pause:step={middle + 2}:rank=1:seconds=8;kill:step={middle + 5}:rank=0"],
        "validation": [f"pause:step={2 * per_epoch}:rank=0:seconds=45"],
        "slow restore": [f"pause:restore=0:rank=1:seconds=20;kill:step={middle}:rank=1"],
        "beside another": ["", ""],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-class", type=int, default=160, help="training images per class (default: 160)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each run (default: 4)")
    parser.add_argument("--interval", type=int, default=10, help="checkpoint every N steps (default: 10)")
    parser.add_argument("--slow-write", type=float, default=8.0,
                        help="seconds each checkpoint write of the slow-saves run takes more (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stopped step (default: 0)")
    parser.add_argument("--only", default="", help="comma-separated runs to make: stopped and scenario names "
                                                   "(default: all)")
    parser.add_argument("--timeout", type=float, default=900, help="give up on a run after this many s")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    steps = args.epochs * (CLASSES * args.per_class // GLOBAL_BATCH)
    stop_step = random.Random(args.seed).randint(steps // 4, 3 * steps // 4)
    wanted = set(filter(None, args.only.split(",")))
    scenarios = {name: plans for name, plans in false_alarm_plans(steps, args).items()
                 if not wanted or name in wanted}
    detect = recover = float("nan")
    false_alarms = 0
    with experiment_dir("hang-recovery-", args.keep) as root:
        if not wanted or "stopped" in wanted:
            print(f"{steps} steps a run; the stopped run: rank 1 stops after step {stop_step}")
            events = finished(root, "stopped", start_job(root, "stopped", f"stop:step={stop_step}:rank=1", args),
                              args)
            if events is None:
                raise SystemExit("the stopped run failed")
            detect, recover = hang_timings(events, stop_step)
            print(f"stopped run: hang declared {detect:.2f} s after the stop, the new attempt's first step "
                  f"{recover:.2f} s after it (vs {HEALTH_CHECK_TIMEOUT_S:.0f} s before Ray's health check alone "
                  f"replaces the worker: ratio {recover / HEALTH_CHECK_TIMEOUT_S:.3f})")
        for scenario, plans in scenarios.items():
            names = [f"{scenario.replace(' ', '-')}-{i}" for i in range(len(plans))]
            jobs = [start_job(root, name, plan, args) for name, plan in zip(names, plans)]
            alarms = 0
            for name, job in zip(names, jobs):
                events = finished(root, name, job, args)
                hangs = [e for e in events or [] if e["kind"] == "hang"]
                alarms += len(hangs) if events is not None else max(1, len(hangs))
                for hang in hangs:
                    print(f"  {name}: {hang['error'].splitlines()[0][:300]}")
                if events is not None:
                    print(f"  {name}: {evidence(events)}")
            false_alarms += alarms
            print(f"{scenario} ({'; '.join(p or 'no faults' for p in plans)}): {alarms} false alarms")
    print(f"hang_detect_seconds={detect:.2f} hang_recover_seconds={recover:.2f} false_alarms={false_alarms} "
          f"false_alarm_scenarios={len(scenarios)}")


if __name__ == "__main__":
    main()
