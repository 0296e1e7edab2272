"""Recovery from a worker kill: time from the kill to the first step completed after the restore.

Setup
    A local multi-node Ray cluster (``ray_resilient.testing.kit.chaos_cluster``): a head node with 0
    CPUs (no worker lands on it) plus one worker node with ``--node-cpus`` CPUs (default 2). A
    driver process runs one ``TorchTrainer`` through the configuration
    :func:`ray_resilient.recommended_ray_config` recommends (``--workers`` CPU workers on gloo,
    ``max_failures`` = the number of kills, the Ray Train environment it exports: health check
    every 0.5 s, worker-group start timeout 10 s), with ``ResilientRayConfig.fit``
    (``ray_resilient.testing.kit.fit_on``).

    The train function is the experiment kit's whole-group restart loop
    (``ray_resilient.testing.kit.train_restarting``): a small MLP (32 -> 512 -> 512 -> 512 -> 4, fp32,
    SGD with momentum: 2.2 MB of parameters, 4.4 MB of state), wrapped in DDP by
    ``prepare_model``, on ``SyntheticBatches`` (resumable in-memory data). A step is
    ``--step-seconds`` of ``time.sleep`` emulating accelerator compute, then one real
    forward/backward/``optimizer.step()`` on the rank's slice of a ``--global-batch`` (64) sample
    global batch. ``Checkpointer`` checkpoints every ``--interval`` steps (sharded async DCP) and
    restores the newest complete checkpoint, data position included.

    ``--kills`` SIGKILLs of one worker process at seeded random steps come from
    ``random_kill_plan(seed, kills=K, steps=S, interval=I, world_size=W, upload_kills=0)``: the
    ``kill:step=N:rank=R`` fault fires inside ``step_completed`` right after step N, once per run.
    Every kill makes Ray Train restart the whole worker group, and gives one recovery sample.
    The same plan runs twice, each on a fresh cluster: without and with spare workers.

Timing
    Every process records timed events (the kit's records): train function entered, imports done,
    model ready, ``restore()`` called and returned (with the restored step), first batch in hand
    after the restore, and every step (recorded just before ``step_completed``, so the killed
    rank's record of step N is the moment of the kill, to a few hundred microseconds). The
    controller's decision to restart is the ``[FailurePolicy] RETRY`` record of Ray Train's
    controller log. A point of the restarted attempt counts when the last rank has passed it (the
    ranks wait for each other at the next collective anyway). Columns of the table, one row per
    kill (``ray_resilient.testing.kit.recovery_phases``; all in seconds, they add up to ``recovery``):

    detect       kill -> the controller's RETRY decision. The controller polls the workers every
                 ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (0.5 s) and sees the dead actor.
    restart      RETRY -> the train function entered on every rank of the new worker group: the old
                 group (the surviving rank, stuck in an all-reduce) is killed, a new placement group
                 and new worker actors are started (new processes: ``import torch``, Ray Train),
                 the torch process group is set up.
    setup        train function entered -> ``restore()`` called: model, ``prepare_model`` (DDP
                 broadcasts the parameters), optimizer, data, ``Checkpointer`` (its gloo group).
    restore      ``Checkpointer.restore()``: find the newest complete checkpoint, load it (DCP).
    ffwd         ``restore()`` returned -> the first batch at the restored data position in hand
                 (data fast-forward; ``SyntheticBatches`` seeks by index, so this is tiny here).
    first_step   that batch -> the first step completed after the restore (one step: sleep,
                 forward/backward/all-reduce, plus first-iteration costs).
    recovery     kill -> the first step completed after the restore (the sum of the above).
    recomputed   the killed step minus the restored step: steps trained again.

    A second table splits two phases further (seconds):

    stop+pg      RETRY -> the new placement group is ready (old group shut down, resources freed);
                 controller log "Placement group ready".
    actors       -> the new worker actors exist (new Ray worker processes); "worker actors created".
    context      -> Ray Train's context initialized on the workers (in a fresh process this imports
                 torch: it is already in ``sys.modules`` when the train function starts);
                 "Train context initialized".
    launch       -> the train function entered on every rank (torch process group set up, launch).
    imports      train function entered -> its imports done (``ray.train.torch``, ``synthetic_data``).
    model        -> model, DDP, optimizer and data built.
    manager      -> ``Checkpointer`` imported and constructed (``restore()`` is called next).

    The last line printed is the summary the issue asks for (medians over the kills, with spares)::

        recovery_seconds=<median> recomputed_steps=<median> restore_seconds=<median>

Machine
    A 2-core AMD EPYC Firecracker VM, 24 GiB RAM, torch CPU, Ray 2.60 (Train V2), shared with other
    users' jobs: the two workers, Ray's processes (GCS, two raylets, the controller) and the driver
    share the 2 cores. Results and what dominates them: ``docs/benchmarks.md``.

Run: ``python benchmarks/recovery.py`` (about 4 minutes; ``--kills 2 --steps 120`` for a quick try).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from ray_resilient import random_kill_plan
from ray_resilient.testing.kit import (
    PHASES,
    RESTART_DETAIL,
    SETUP_MARKS,
    ChaosJob,
    RecordKind,
    chaos_cluster,
    experiment_dir,
    finite_median,
    fit_on,
    kill_moments,
    median_step_seconds,
    of_kind,
    recovery_phases,
    train_restarting,
)

SAMPLES = 4096


def print_table(rows: list[dict[str, Any]], columns: tuple[str, ...], ints: tuple[str, ...] = ()) -> dict[str, float]:
    """One line per row and a median line; returns the medians."""
    keys = ("kill_step", "rank") + tuple(c for c in columns if c not in ("kill_step", "rank"))
    print(" ".join(f"{c:>13}" for c in keys))
    for row in rows:
        print(" ".join(f"{row[c]:>13d}" if c in ("kill_step", "rank", *ints) else f"{row[c]:>13.4f}" for c in keys))
    med = {c: finite_median([r[c] for r in rows]) for c in keys}
    print(" ".join(f"{'median':>13}" if c == "kill_step" else f"{'':>13}" if c in ("rank", "restored_step")
                   else f"{med[c]:>13.4f}" for c in keys))
    return med


def print_report(rows: list[dict[str, Any]], records: list[dict[str, Any]], fit_start: float,
                 args: argparse.Namespace, plan: str) -> dict[str, float]:
    """The tables of one run; returns the medians."""
    print(f"\nRecovery from a SIGKILL of one of {args.workers} workers (checkpoint every {args.interval} steps, "
          f"{args.step_seconds}s of emulated compute a step), seconds per phase:")
    print(f"plan: {plan}")
    med = print_table(rows, ("restored_step", *PHASES, "recovery", "recomputed"), ints=("restored_step", "recomputed"))
    print("\nrestart and setup in detail (seconds; restart = stop+pg + actors + context + launch, "
          "setup = imports + model + manager):")
    detail = print_table(rows, (*RESTART_DETAIL, *SETUP_MARKS))
    phases = {p: med[p] for p in PHASES if not math.isnan(med[p])}
    top = max(phases, key=phases.get)
    share = {p: 100 * v / med["recovery"] for p, v in phases.items()}
    print(f"\n'{top}' dominates: {phases[top]:.2f}s of the median {med['recovery']:.2f}s recovery "
          f"({share[top]:.0f}%); then " + ", ".join(
              f"{p} {phases[p]:.3f}s ({share[p]:.0f}%)" for p in sorted(phases, key=phases.get, reverse=True)
              if p != top) + ".")
    parts = {p: detail[p] for p in (*RESTART_DETAIL, *SETUP_MARKS) if not math.isnan(detail[p])}
    if parts:
        largest = sorted(parts.items(), key=lambda kv: -kv[1])[:4]
        print("largest parts: " + ", ".join(f"{p} {v:.2f}s" for p, v in largest)
              + f"; modules already imported when the train function started: {rows[0]['preloaded'] or 'none'}")
    starts = of_kind(records, RecordKind.START)
    first_step = min(r["t"] for r in of_kind(records, RecordKind.STEP))
    print(f"steady step time {median_step_seconds(records):.3f}s; first start (fit() called -> first step): "
          f"{first_step - fit_start:.2f}s; train function entries: {len(starts)} "
          f"({len(rows) + 1} attempts x {args.workers} ranks expected)")
    return med


def run(args: argparse.Namespace, plan: str, spares: bool) -> dict[str, float]:
    """One run on a fresh local cluster, its tables printed; returns the medians."""
    job = ChaosJob(seed=args.seed, samples=SAMPLES, global_batch=args.global_batch, max_steps=args.steps,
                   step_seconds=args.step_seconds, interval=args.interval, faults=plan)
    with experiment_dir("recovery-", args.keep) as root, chaos_cluster(root, args.node_cpus) as cluster:
        fit = fit_on(cluster, root, "recovery", train_restarting, job, workers=args.workers,
                     max_failures=args.kills, spare_workers=spares, timeout=args.timeout)
        records = fit.records()
        rows = recovery_phases(records, kill_moments(records, plan), fit.ray_dir)
        print(f"fit() took {fit.fit_end - fit.fit_start:.1f}s")
        return print_report(rows, records, fit.fit_start, args, plan)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=5, help="worker kills, one recovery each (default: 5)")
    parser.add_argument("--steps", type=int, default=300, help="training steps of the run (default: 300)")
    parser.add_argument("--interval", type=int, default=20, help="checkpoint every N steps (default: 20)")
    parser.add_argument("--step-seconds", type=float, default=0.05,
                        help="emulated accelerator compute per step (default: 0.05)")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default: 2)")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per global batch (default: 64)")
    parser.add_argument("--node-cpus", type=int, default=2, help="CPUs of the worker node (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill plan and the data (default: 0)")
    parser.add_argument("--timeout", type=float, default=600, help="give up on the run after this many s")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (Ray logs, records, checkpoints)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    plan = random_kill_plan(args.seed, kills=args.kills, steps=args.steps, interval=args.interval,
                            world_size=args.workers, upload_kills=0)
    results = {}
    for spares in (False, True):  # the product's default (spares) last: its summary is the last line
        name = "with spare workers (the default)" if spares else "without spare workers (spare_workers=False)"
        print(f"\n=== {name} ===")
        results[spares] = run(args, plan, spares)
    off, on = results[False], results[True]
    print(f"\nspare workers: median recovery {on['recovery']:.2f}s vs {off['recovery']:.2f}s without "
          f"(ratio {on['recovery'] / off['recovery']:.2f}); restart {on['restart']:.2f}s vs {off['restart']:.2f}s, "
          f"setup {on['setup']:.2f}s vs {off['setup']:.2f}s")
    print(f"recovery_seconds={on['recovery']:.3f} recomputed_steps={on['recomputed']:g} "
          f"restore_seconds={on['restore']:.4f}")


if __name__ == "__main__":
    main()
