"""Hang recovery of the main job: a worker stopped with SIGSTOP, found by the hang watchdog, replaced.

Setup
    The README's main job, ``jobs/train_images.py``, as a user runs it (a Ray instance of its own,
    a local run directory and MLflow store, in a scratch directory): ResNet-18 on the embedded
    dataset (``--per-class`` images of each of 4 classes, 32x32), 2 workers (``--min-workers`` and
    ``--max-workers`` 2), DDP, a checkpoint every ``--interval`` steps, the hang watchdog at its
    defaults (``HangWatchdogConfig``: a rank is hung after ``max(5 s, 10 x`` the p99 of its recent
    steps' longest stretch without progress``)`` with none). Two runs of the same length,
    one after the other:

    stopped   rank 1 stops itself with SIGSTOP right after a seeded step (``stop:step=N:rank=1``,
              N drawn from ``--seed`` in the middle half of the run): a hang without dying, its
              sockets open. Rank 0 waits in the next all-reduce.
    clean     no stop; instead every checkpoint's write on rank 1 takes ``--slow-write`` seconds
              more (``slow_write:upload=S:rank=1:seconds=X``): slow saves, the final one waited
              for, and rank 0's validation pass each epoch while rank 1 waits. None is a hang.

Measurement (from the runs' goodput ledgers)
    stop                  rank 0's record of step N (the ranks finish a step together in DDP's
                          all-reduce; rank 1 stops right after it).
    hang_detect_seconds   stop -> the watchdog's ``hang`` event (the attempt declared failed, the
                          hung process about to be killed).
    hang_recover_seconds  stop -> the first step of the new attempt (rank 0's record: only rank 0
                          records steps, and the ranks finish a step together).
    false_alarms          ``hang`` events in the clean run.

    The alternative without the watchdog is Ray's worker health check: a live worker that does
    not answer is replaced after ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S`` (600 s in Ray, 60 s
    in ``recommended_ray_config``); the ratio printed is against the recommended 60 s.

The last line::

    hang_detect_seconds=<s> hang_recover_seconds=<s> false_alarms=<n>

Results: ``docs/benchmarks.md``. Run: ``python benchmarks/hang_recovery.py`` (about 6 minutes).
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
from ray_resilient.testing import experiment_dir

JOB = Path(__file__).resolve().parent.parent / "jobs" / "train_images.py"
CLASSES = 4
GLOBAL_BATCH = 64  # the job's default
HEALTH_CHECK_TIMEOUT_S = 60.0  # recommended_ray_config's RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S


def run_job(root: Path, name: str, faults: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the main job in ``root`` under ``name`` with ``faults``; its ledger's events."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow.db"
    command = [sys.executable, str(JOB), "--per-class", str(args.per_class), "--epochs", str(args.epochs),
               "--interval", str(args.interval), "--min-workers", "2", "--max-workers", "2",
               "--storage-path", str(root / "runs"), "--name", name, "--faults", faults]
    with open(root / f"{name}.log", "w") as log:
        done = subprocess.run(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"the {name} run failed ({done.returncode}); see {root / f'{name}.log'} (--keep keeps it)")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-class", type=int, default=160, help="training images per class (default: 160)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each run (default: 4)")
    parser.add_argument("--interval", type=int, default=10, help="checkpoint every N steps (default: 10)")
    parser.add_argument("--slow-write", type=float, default=8.0,
                        help="seconds each checkpoint write of the clean run takes more (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stopped step (default: 0)")
    parser.add_argument("--timeout", type=float, default=900, help="give up on a run after this many s")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    steps = args.epochs * (CLASSES * args.per_class // GLOBAL_BATCH)
    stop_step = random.Random(args.seed).randint(steps // 4, 3 * steps // 4)
    slow = ";".join(f"slow_write:upload={s}:rank=1:seconds={args.slow_write}"
                    for s in range(args.interval, steps, args.interval))
    print(f"{steps} steps a run; the stopped run: rank 1 stops after step {stop_step}; the clean run: {slow}")
    with experiment_dir("hang-recovery-", args.keep) as root:
        detect, recover = hang_timings(run_job(root, "stopped", f"stop:step={stop_step}:rank=1", args), stop_step)
        print(f"stopped run: hang declared {detect:.2f} s after the stop, the new attempt's first step "
              f"{recover:.2f} s after it (vs {HEALTH_CHECK_TIMEOUT_S:.0f} s before Ray's health check alone "
              f"replaces the worker: ratio {recover / HEALTH_CHECK_TIMEOUT_S:.3f})")
        false_alarms = sum(e["kind"] == "hang" for e in run_job(root, "clean", slow, args))
        print(f"clean run with slow saves: {false_alarms} hangs declared")
    print(f"hang_detect_seconds={detect:.2f} hang_recover_seconds={recover:.2f} false_alarms={false_alarms}")


if __name__ == "__main__":
    main()
