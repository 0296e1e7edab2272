"""Survivor mode vs whole-group restart: what a worker's SIGKILL costs the workers that remain.

Setup
    The job and cluster of ``benchmarks/recovery.py``, from the experiment kit
    (``ray_resilient.testing.kit``): a local multi-node Ray cluster (``chaos_cluster``: a head with 0
    CPUs plus one worker node with ``--node-cpus`` CPUs, default 3), the MLP 32 -> 512 -> 512 ->
    512 -> 4 (2.2 MB of parameters) with SGD and momentum, ``SyntheticBatches`` with a
    ``--global-batch`` of 96 samples, a step of ``--step-seconds`` (0.05) of ``time.sleep``
    emulating accelerator compute per micro-batch plus the real forward/backward, 3 workers, a
    checkpoint every ``--interval`` (20) steps, and the same seeded plan of ``--kills`` (5)
    SIGKILLs of one worker right after a step (``spaced_kill_plan``: ``kill:step=N:rank=R``,
    kill ``i`` within a quarter gap of step ``i x steps / (kills + 1)``, of a random rank, so that
    a replacement (10-20 s to start here) has joined before the next kill and every planned kill
    finds its replica). Both modes run in one invocation, each on a fresh cluster, through
    ``recommended_ray_config`` with spare workers:

    restart    the kit's whole-group restart loop (``train_restarting``, as in ``recovery.py``):
               every kill restarts the whole worker group, which restores the newest
               checkpoint. ``restart_seconds`` is its recovery per kill: kill -> the first step
               completed after the restore (``recovery_phases``).
    survivors  the kit's survivor loop (``train_survivors``), ``recommended_ray_config(...,
               survivors=True)``, with 3 micro-batches of 32 (one per replica; two on one replica
               while one is missing): the survivors drop the step in flight, re-form without the
               dead replica and train the same global batch again; Ray starts a replacement that
               copies its state from a live replica and joins. Its plan adds one SIGSTOP of a
               replica after the last kill (``stop:step=N:rank=R``, halfway to the end, of a rank
               other than the last killed): a hang without dying, which only the replica's silence
               shows (its heartbeats stop); Ray replaces it after its worker health-check timeout.

Measurement (survivor mode)
    Every process records each micro-batch it computes (its sample ids) and each step it commits
    (its time, the membership that trained it). ``pause`` per kill (``survivor_pauses``) = on the
    slowest survivor, the time from its commit of the killed step N to its commit of step N+1,
    minus the median step (so a pause of 0 is a step that took no longer than usual). ``join`` =
    the same for the step at which the replacement was taken in. ``recomputed_steps`` = steps
    dropped (the ledger's ``step_discarded``, counted once per membership change:
    ``discarded_steps``). Samples (``kept_samples`` against ``planned_samples``): a step counts
    once, with the micro-batches its membership computed for it (a replica killed right after the
    step's exchange included), when that membership went on from it; a sample of the plan kept
    zero times is ``lost``, kept more than once ``repeated``. ``hang_pause`` = the pause for the
    stopped replica, measured the same way. ``registered_checkpoints`` = the lead's checkpoints
    Ray holds at the end
    (``Result.best_checkpoints``; the run keeps them all).

The last line::

    survivor_pause_seconds=<median> restart_seconds=<median, whole-group mode> recomputed_steps=<survivor mode, total> lost_samples=<n> repeated_samples=<n> hang_pause_seconds=<s> registered_checkpoints=<n>

Results: ``docs/benchmarks.md``. Run: ``python benchmarks/survivor_recovery.py`` (about 8 minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from ray_resilient import parse_faults
from ray_resilient.testing.kit import (
    ChaosJob,
    Pause,
    chaos_cluster,
    discarded_steps,
    experiment_dir,
    finite_median,
    fit_on,
    kept_samples,
    kill_moments,
    median_step_seconds,
    planned_samples,
    recovery_phases,
    sample_errors,
    spaced_kill_plan,
    survivor_pauses,
    train_restarting,
    train_survivors,
)

MICRO_BATCHES = 3  # one per worker
SAMPLES = 4096


def run_restarting(args: argparse.Namespace, job: ChaosJob) -> tuple[float, int]:
    """The whole-group restart run on a fresh cluster, its recoveries printed: (median recovery, steps recomputed)."""
    with (experiment_dir("survivor-recovery-restart-", args.keep) as root,
          chaos_cluster(root, args.node_cpus) as cluster):
        fit = fit_on(cluster, root, "restart", train_restarting, job, workers=MICRO_BATCHES, max_failures=args.kills,
                     timeout=args.timeout)
        records = fit.records()
        rows = recovery_phases(records, kill_moments(records, job.faults), fit.ray_dir)
    print(f"{'kill_step':>10} {'rank':>5} {'restored':>9} {'recovery':>9} {'recomputed':>11}")
    for row in rows:
        print(f"{row['kill_step']:>10d} {row['rank']:>5d} {row['restored_step']:>9d} {row['recovery']:>9.3f} "
              f"{row['recomputed']:>11d}")
    return finite_median([r["recovery"] for r in rows]), sum(r["recomputed"] for r in rows)


def with_a_stop(job: ChaosJob, seed: int) -> ChaosJob:
    """``job`` with a SIGSTOP of a replica halfway from its last kill to its end (not of the
    replica killed last, whose replacement may still be joining)."""
    last = parse_faults(job.faults)[-1]
    rank = random.Random(seed).choice([r for r in range(MICRO_BATCHES) if r != last.rank])
    return dataclasses.replace(job, faults=f"{job.faults};stop:step={(last.step + job.max_steps) // 2}:rank={rank}")


def run_survivors(args: argparse.Namespace, job: ChaosJob) -> tuple[list[Pause], Pause, float, int, int, int, int]:
    """The survivor-mode run on a fresh cluster: (pauses per kill, the pause for the stopped
    replica, median step, steps dropped, lost samples, repeated samples, checkpoints registered)."""
    with (experiment_dir("survivor-recovery-", args.keep) as root,
          chaos_cluster(root, args.node_cpus) as cluster):
        fit = fit_on(cluster, root, "survivors", train_survivors, job, workers=MICRO_BATCHES,
                     max_failures=args.kills + 1, timeout=args.timeout, survivors=True)  # the stop too
        records = fit.records()
        repeated, lost = sample_errors(kept_samples(records), planned_samples(job))
        stop, = survivor_pauses(records, kill_moments(records, job.faults, action="stop"))
        return (survivor_pauses(records, kill_moments(records, job.faults)), stop, median_step_seconds(records),
                discarded_steps(fit.run_dir), lost, repeated, len(fit.registered))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="worker kills (default: 5)")
    parser.add_argument("--steps", type=int, default=1200, help="training steps of the run (default: 1200)")
    parser.add_argument("--interval", type=int, default=20, help="checkpoint every N steps (default: 20)")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="emulated compute per micro-batch")
    parser.add_argument("--global-batch", type=int, default=96, help="samples per global batch (default: 96)")
    parser.add_argument("--node-cpus", type=int, default=3, help="CPUs of the worker node (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill plan and the data (default: 0)")
    parser.add_argument("--timeout", type=float, default=600, help="give up on a run after this many s")
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    plan = spaced_kill_plan(args.seed, args.kills, args.steps, MICRO_BATCHES)
    print(f"plan: {plan}")
    job = ChaosJob(seed=args.seed, samples=SAMPLES, global_batch=args.global_batch, max_steps=args.steps,
                   step_seconds=args.step_seconds, interval=args.interval, faults=plan)
    print("\n=== whole-group restart, with spare workers ===")
    restart, restart_recomputed = run_restarting(args, job)

    print("\n=== survivor mode ===")
    started = time.time()
    pauses, stop, usual, recomputed, lost, repeated, registered = run_survivors(args, with_a_stop(job, args.seed))
    print(f"(run took {time.time() - started:.0f} s; median step {usual:.3f} s)")
    print(f"{'kill_step':>10} {'rank':>5} {'survivors':>10} {'pause':>8} {'joined_at':>10} {'join':>8}")
    for p in pauses:
        print(f"{p.kill.step:>10d} {p.kill.rank:>5d} {p.survivors:>10d} {p.pause:>8.3f} {p.joined_at:>10d} "
              f"{p.join:>8.3f}")
    pause = finite_median([p.pause for p in pauses])
    print(f"median pause {pause:.3f} s vs median whole-group recovery {restart:.3f} s "
          f"(ratio {pause / restart:.3f}); median pause when a replacement joined "
          f"{finite_median([p.join for p in pauses]):.3f} s; recomputed steps {recomputed} "
          f"(whole-group mode: {restart_recomputed}); pause for the replica stopped after step "
          f"{stop.kill.step}: {stop.pause:.3f} s")
    print(f"survivor_pause_seconds={pause:.3f} restart_seconds={restart:.3f} "
          f"recomputed_steps={recomputed} lost_samples={lost} repeated_samples={repeated} "
          f"hang_pause_seconds={stop.pause:.3f} registered_checkpoints={registered}")


if __name__ == "__main__":
    main()
