"""Goodput under chaos: ray_resilient, its survivor mode and the naive checkpointing baseline, same job, same kills.

Setup
    One local multi-node Ray cluster (``ray_resilient.testing.kit.chaos_cluster``: a head node with 0
    CPUs plus one worker node with ``--node-cpus`` CPUs, default 2) runs three ``fit()`` calls, one
    after the other, each from its own driver process (``ray_resilient.testing.kit.fit_on``) through
    :func:`ray_resilient.recommended_ray_config` (``--workers`` CPU workers on gloo, health check
    every 0.5 s, ``max_failures`` = the kills scheduled) and ``ResilientRayConfig.fit`` (which
    records the driver's ``job_start`` in the run's goodput ledger). Storage is local disk.

    The job (``ray_resilient.testing.kit.ChaosJob``), the same in every run: ``--steps`` steps (4
    epochs of 50 global batches) of the main job's model, torchvision's ResNet-18 (11.2M
    parameters, BatchNorm; fp32) with Adam, so parameters plus Adam's two moments take 128 MiB,
    on the main job's data: the volume dataset (``VolumeImageDataset`` through a
    ``VolumeDataLoader``, one loader worker a rank, the main job's augmentation at
    ``--image-size`` 32) over ``--samples`` 800 JPEGs of 4 shapes that ``make_image_volume``
    writes to local disk first, the order a pure function of (seed, epoch). A step is
    ``--step-seconds`` of ``time.sleep`` emulating accelerator compute, then one real
    forward/backward/``optimizer.step()`` on the rank's 8 samples of a 16-sample global batch; in
    DDP 43 MiB of gradients are all-reduced a step over gloo. ``--model mlp`` trains instead an
    MLP (32 -> 2529, then 7 square 2529 x 2529 layers, -> 4) on ``SyntheticBatches``: 44.9M
    parameters, a 514 MiB state (``--state-mb``, at least 512), 171 MiB of gradients a step.

    Kills: ``--kills`` (4) in one seeded schedule for every run, in wall-clock time from ``fit()``
    (``timed_kill_schedule``): gaps drawn uniformly from [0.75, 1.25] x ``--mtbf`` (60 s), each
    of a random rank, which SIGKILLs itself at the end of its first step after the moment, once
    per run. A schedule in steps would hand the slower run fewer failures an hour. The count is
    fixed so that the naive run finishes: it needs an epoch without a failure to get past one.
    Every kill makes Ray Train restart the whole worker group, except in survivor mode.

The three runs
    resilient  the kit's restart loop (``train_restarting``): ``CheckpointConfig(interval_steps="auto",
               mtbf_s=60)``, sharded asynchronous DCP checkpoints registered with Ray once
               durable, restore of the newest complete one with the exact data position, spare
               worker processes for the next restart. The interval: a first save after 10 steps,
               then after every save Daly's interval from the measured stall and step time.
    naive      what most teams write first (:class:`NaiveCheckpoints`): rank 0 ``torch.save``s
               model + optimizer ``state_dict()``, every rank calls ``ray.train.report`` with the
               default SYNC upload; restore: every rank ``torch.load``s ``get_checkpoint()``; no
               spare workers. Its interval comes from the Checkpointer's own ``SavePolicy("auto")``,
               so neither run is handicapped by a badly chosen interval. Its step is its position
               in the data (as a plain ``for epoch ...: for batch in loader`` loop counts it);
               after a restore its data starts over at the first batch of the checkpoint's epoch,
               as a plain ``DataLoader`` does, so the positions since then are trained again (the
               ledger counts their first run as wasted: a step number recorded again). It records
               the same ledger events as the checkpointer does.
    survivors  the kit's survivor loop (``train_survivors``), ``recommended_ray_config(...,
               survivors=True)``: each worker a whole replica (no DDP), the global batch cut into
               ``--workers`` micro-batches of 8 that each replica reads from the same volume
               dataset, each micro-batch's gradient a row of the exchange (a gloo all-to-all and
               all-gather: at 2 workers what DDP's all-reduce moves, but after the backward
               pass); BatchNorm's running statistics merged over the step's micro-batches in
               order. A kill makes the survivor drop the step in flight and train it
               again alone; Ray replaces only the dead worker, which copies the state from the
               survivor and joins at a step boundary. The lead saves a DCP checkpoint every
               ``--survivor-interval`` steps (50: the safety net for losing the whole job).

Measurement
    Goodput and its breakdown come from each run's ledger (``ray_resilient.goodput.account``),
    the planner's inputs from ``measured_inputs`` (median save stall, median restart, median kept
    step). The interval a run checkpointed at is the last gap between two consecutive saves of
    an attempt (the first save after a start and the final save excluded). The prediction is the
    planner's ``expected_goodput(interval_steps x step_s, save_stall, restart, mtbf=60)``.
    Resampling, from the kit's records (the sample ids of each step, or each micro-batch):
    ``kept_samples`` against ``planned_samples``; (epoch, sample id) pairs kept more often than
    an uninterrupted run has them are "trained twice", pairs it has and no kept step trained are
    "skipped"; ``naive_resampled`` is their sum. A step counts with the micro-batches of the
    membership that went on from it. In survivor mode the planner's prediction does not apply (no
    restarts); instead, per kill, the survivor's pause (``survivor_pauses``): from its commit of
    the killed replica's last step to its commit of the next one, less the median step. The PNG
    timelines are ``ray_resilient.goodput.render_report``'s.

Machine
    A 2-core AMD EPYC Firecracker VM, 24 GiB RAM, torch CPU, Ray 2.60 (Train V2), shared with
    other users' jobs (the table shows how much CPU they used). The workers, Ray's processes and
    the background checkpoint writes share the 2 cores: unlike on accelerators, an asynchronous
    write slows the training steps it overlaps, and the ledger counts step time as productive, so
    the table also shows each run's median step and the wall time each needed for the same steps.

The last line printed is the summary the issue asks for (the line before it: ``survivor_goodput=<x>``)::

    goodput=<x> naive_goodput=<y> predicted_goodput=<z> naive_resampled=<count>

Results, their tables and timelines: ``docs/goodput_chaos.md``.

Run: ``python benchmarks/goodput_chaos.py`` (about 20 minutes on a quiet machine; ``--steps 60
--mtbf 25`` for a quick try of the mechanics). The PNG timelines go to ``--figures`` (default:
the working directory, ``goodput_chaos_figures/``; ``--figures docs`` replaces the README's).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray_resilient.goodput import EventKind
from ray_resilient.testing import CLASSES, make_image_volume
from ray_resilient.testing.kit import (
    ChaosJob,
    Fit,
    RecordKind,
    Worker,
    chaos_cluster,
    experiment_dir,
    finite_median,
    fit_on,
    foreign_cpu,
    job_model,
    kept_samples,
    kill_moments,
    planned_samples,
    sample_errors,
    survivor_pauses,
    timed_kill_schedule,
    train_restarting,
    train_survivors,
)

BENCHMARKS = Path(__file__).resolve().parent
RESILIENT, NAIVE, SURVIVORS = "resilient", "naive", "survivors"
RUNS = (RESILIENT, NAIVE, SURVIVORS)
HIDDEN_LAYERS = 7  # square hidden Linear layers; their width sets the state size
ADAM_BYTES_PER_PARAM = 12  # fp32 parameter + Adam's two fp32 moments
NAIVE_STATE_FILE = "state.pt"


def model_width(state_mb: float) -> int:
    """The hidden width at which the job's MLP with Adam takes at least ``state_mb`` MiB."""
    return math.ceil(math.sqrt(state_mb * 2**20 / ADAM_BYTES_PER_PARAM / HIDDEN_LAYERS))


def state_mib(job: ChaosJob) -> float:
    """fp32 parameters + Adam's two moments of the job's model, MiB (counted on the meta device)."""
    import torch

    with torch.device("meta"):
        params = sum(p.numel() for p in job_model(job).parameters())
    return params * ADAM_BYTES_PER_PARAM / 2**20


# --- the naive baseline (runs in the Ray workers, which import this module as `goodput_chaos`) -------


class NaiveCheckpoints:
    """The checkpointing most teams write first, recording the same goodput ledger as ray_resilient.

    Rank 0 ``torch.save``s the whole model and optimizer ``state_dict()`` into a temp dir and every
    rank calls ``ray.train.report(checkpoint=...)`` with the default SYNC upload (Ray copies the
    directory into the run storage before returning); the temp dir is then removed. The loop
    stalls for all of it. Restore: every rank ``torch.load``s the checkpoint Ray hands back. When
    to save is the ``Checkpointer``'s ``SavePolicy("auto")``: the same rule, from rank 0's stall
    and median step time.
    """

    def __init__(self, worker: Worker):
        import torch.distributed as dist

        from ray_resilient.checkpoint import SavePolicy
        from ray_resilient.goodput import LedgerWriter
        from ray_resilient.storage import RunStorage

        self.worker = worker
        self.policy = SavePolicy("auto", mtbf_s=worker.job.mtbf_s)
        self.group = dist.group.WORLD
        self.ledger = LedgerWriter(RunStorage.from_ray_context(), 0) if worker.rank == 0 else None
        self.record(EventKind.ATTEMPT_START, world_size=worker.world)
        self.last_saved = -1
        self.mark = time.time()

    def record(self, kind: EventKind, **fields: Any) -> None:
        if self.ledger is not None:
            self.ledger.record(kind, **fields)

    def restore(self) -> tuple[int, int]:
        """Load the newest checkpoint Ray registered into model and optimizer; returns (the checkpoint's
        step, the step the loop goes on from: the first of the checkpoint's epoch)."""
        import ray.train
        import torch

        started = time.time()
        saved = 0
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                state = torch.load(os.path.join(directory, NAIVE_STATE_FILE), map_location="cpu")
            self.worker.module.load_state_dict(state["model"])
            self.worker.optimizer.load_state_dict(state["optimizer"])
            saved = self.last_saved = state["step"]
        per_epoch = self.worker.batches_per_epoch
        resumed = saved // per_epoch * per_epoch
        self.policy.restored(resumed)
        self.mark = time.time()
        self.record(EventKind.RESTORE, t=self.mark, t_start=started, step=resumed)
        return saved, resumed

    def step_completed(self, step: int, epoch: int) -> None:
        ended = time.time()
        self.record(EventKind.STEP, t=ended, step=step, t_start=self.mark, data_wait=0.0)
        self.policy.step_finished(ended - self.mark)
        if self.policy.due(step):
            stall = self.save(step, epoch)
            self.policy.saved(step, stall, stall, self.group)  # synchronous: durable when the stall ends
        self.mark = time.time()

    def save(self, step: int, epoch: int) -> float:
        """torch.save on rank 0 + synchronous report; returns the stall (s)."""
        import ray.train
        import torch
        from ray.train import Checkpoint

        started, wall_started = time.monotonic(), time.time()
        directory, checkpoint = None, None
        if self.worker.rank == 0:
            directory = tempfile.mkdtemp(prefix="naive-checkpoint-")
            torch.save({"model": self.worker.module.state_dict(), "optimizer": self.worker.optimizer.state_dict(),
                        "step": step, "epoch": epoch}, os.path.join(directory, NAIVE_STATE_FILE))
            checkpoint = Checkpoint.from_directory(directory)
        ray.train.report({"step": step, "epoch": epoch}, checkpoint=checkpoint)
        self.record(EventKind.DURABLE, step=step)  # Ray's SYNC upload returned: copied into the run storage (no fsync)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        self.last_saved = step
        self.record(EventKind.SAVE, t=time.time(), step=step, t_start=wall_started)
        return time.monotonic() - started

    def finish(self, step: int, epoch: int) -> None:
        if self.last_saved != step:
            self.save(step, epoch)
        self.record(EventKind.FINISH, step=step)
        if self.ledger is not None:
            self.ledger.close()


def train_naive(config: dict[str, Any]) -> None:
    """The naive baseline: its step is its position in the data; after a restore the data starts over
    at the first batch of the checkpoint's epoch, so the batches since then are trained again."""
    worker = Worker(config)
    ckpt = NaiveCheckpoints(worker)
    saved, step = ckpt.restore()
    worker.start_epoch(step // worker.batches_per_epoch)
    worker.record(RecordKind.RESTORED, step=saved, resumed=step)
    step = worker.train(step, ckpt.step_completed)
    ckpt.finish(step, worker.data.epoch)
    worker.record(RecordKind.FINISHED, step=step)


TRAIN_FNS = {RESILIENT: train_restarting, NAIVE: train_naive, SURVIVORS: train_survivors}


# --- analysis ---------------------------------------------------------------------------------------


def steady_intervals(events: list[dict[str, Any]]) -> list[int]:
    """Steps between consecutive saves of rank 0 within an attempt, without the first save of an
    attempt (the first "auto" save after its start) and the final save (at the last step)."""
    from ray_resilient.goodput import group_attempts

    gaps = []
    for attempt in group_attempts(events)[0]:
        saves = [e["step"] for e in attempt.events if e["kind"] == EventKind.SAVE]
        if attempt.finished:
            saves = saves[:-1]
        gaps += [b - a for a, b in zip(saves, saves[1:])]
    return gaps


def analyse(run: str, fit: Fit, foreign: float, job: ChaosJob, args: argparse.Namespace,
            whole_group_step: float | None = None) -> dict[str, Any]:
    """The measured and predicted goodput of one run, its breakdown, its timeline (PNG) and report;
    in survivor mode also its goodput with slow steps measured against ``whole_group_step``."""
    from ray_resilient.goodput import (
        account, expected_goodput, group_attempts, interval_steps_for, load_events, measured_inputs, render_report,
    )

    run_dir = str(fit.run_dir)
    events = load_events(run_dir)
    breakdown = account(events)
    measured = measured_inputs(run_dir)
    gaps = steady_intervals(events)
    interval_steps = gaps[-1] if gaps else math.nan  # the final interval the run checkpointed at
    interval_s = interval_steps * measured.step_s
    records = fit.records()
    twice, skipped = sample_errors(kept_samples(records), planned_samples(job))
    kills = kill_moments(records)
    png = args.figures / f"goodput_chaos_{run}.png"
    attempts, job_starts = group_attempts(events)
    first_start = attempts[0].first_work() - min([attempts[0].start, *job_starts])
    result = {
        "breakdown": breakdown, "measured": measured, "gaps": gaps, "interval_steps": interval_steps,
        "interval_s": interval_s, "first_start": first_start, "twice": twice, "skipped": skipped,
        "kills": [(kill.t - fit.fit_start, kill.step) for kill in kills], "wall": fit.fit_end - fit.fit_start,
        "foreign_cpu": foreign, "report": render_report(run_dir, str(png)), "png": png,
    }
    if run == SURVIVORS:  # no restarts: the planner's model does not apply
        pause = finite_median([p.pause for p in survivor_pauses(records, kills)])
        return {**result, "pause": pause, "planner_steps": None, "restart": None, "restart_mean": None,
                "predicted": None, "predicted_run": None,
                "against_whole_group": account(events, reference_step_seconds=whole_group_step).goodput}
    restart_mean = statistics.mean(breakdown.restarts) if breakdown.restarts else 0.0
    save_cost = measured.save_stall_s + (measured.save_interference_s or 0.0)  # the planner's S
    return {
        **result, "pause": None, "restart": measured.restart_s or 0.0, "restart_mean": restart_mean,
        "planner_steps": interval_steps_for(args.mtbf, save_cost, measured.step_s),
        "predicted": expected_goodput(interval_s, save_cost, measured.restart_s or 0.0, args.mtbf),
        # the planner's G with the mean restart, scaled by the share of the run after its first start
        "predicted_run": expected_goodput(interval_s, save_cost, restart_mean, args.mtbf)
        * (1 - first_start / breakdown.total),
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One column per run; a value of None (does not apply to that run) shows as "-"."""
    from ray_resilient.goodput import PARTS

    rows: list[tuple[str, ...]] = []

    def row(label: str, fmt: str, key) -> None:
        rows.append((label, *("-" if key(results[run]) is None else fmt.format(key(results[run])) for run in RUNS)))

    row("wall time of fit() (s)", "{:.1f}", lambda r: r["wall"])
    row("other users' CPU use, mean (cores of 2)", "{:.2f}", lambda r: r["foreign_cpu"])
    row("kills / attempts", "{}", lambda r: f"{len(r['kills'])} / {r['breakdown'].attempts}")
    row("checkpoint interval (steps)", "{}", lambda r: r["interval_steps"])
    row("checkpoint interval (s)", "{:.2f}", lambda r: r["interval_s"])
    row("planner's interval from measured (steps)", "{}", lambda r: r["planner_steps"])
    row("save stall, median (s)", "{:.3f}", lambda r: r["measured"].save_stall_s)
    row("save interference, mean (s)", "{:.3f}", lambda r: r["measured"].save_interference_s)
    row("restart, median (s)", "{:.2f}", lambda r: r["restart"])
    row("restart, mean (s)", "{:.2f}", lambda r: r["restart_mean"])
    row("survivors' pause after a kill, median (s)", "{:.2f}", lambda r: r["pause"])
    row("job's first start (s)", "{:.2f}", lambda r: r["first_start"])
    row("step time, median (s)", "{:.3f}", lambda r: r["measured"].step_s)
    row("steps recomputed", "{}", lambda r: r["breakdown"].steps_recomputed)
    row("measured goodput", "{:.3f}", lambda r: r["breakdown"].goodput)
    row("  reference step of its best steady stretch (s)", "{:.3f}", lambda r: r["breakdown"].reference_step_seconds)
    row("  against the resilient run's reference step", "{:.3f}", lambda r: r.get("against_whole_group"))
    row("predicted goodput", "{:.3f}", lambda r: r["predicted"])
    row("  with mean restart and first start", "{:.3f}", lambda r: r["predicted_run"])
    for part in PARTS:
        row(f"  share: {part.replace('_', ' ')}", "{:.1%}", lambda r, part=part: r["breakdown"].shares()[part])
    row("samples trained twice in an epoch", "{}", lambda r: r["twice"])
    row("samples skipped", "{}", lambda r: r["skipped"])
    header = ("", *RUNS)
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(len(header))]
    for line in [header, *rows]:
        print(f"{line[0]:<{widths[0]}}" + "".join(f"  {cell:>{width}}" for cell, width in zip(line[1:], widths[1:])))


def print_results(results: dict[str, dict[str, Any]], args: argparse.Namespace, schedule: list[list[float]],
                  state_size_mib: float) -> None:
    data = "synthetic data" if args.model == "mlp" else f"an image volume of {args.samples} JPEGs"
    print(f"\nGoodput under chaos: {args.steps} steps of a {state_size_mib:.0f} MiB training state (fp32 "
          f"{args.model} + Adam) on {data}, "
          f"{args.workers} workers, {args.step_seconds}s emulated compute + a real DDP step each; kills about one "
          f"every {args.mtbf:.0f}s of wall clock (MTBF given to the planner: {args.mtbf:.0f}s)")
    print("kill schedule (s after fit() started, rank): "
          + ", ".join(f"{at:.0f}s/r{rank}" for at, rank in schedule[:8]) + (" ..." if len(schedule) > 8 else ""))
    for run, r in results.items():
        print(f"  {run}: kills at " + ", ".join(f"{at:.0f}s (step {step})" for at, step in r["kills"])
              + f"; steady save gaps (steps): {r['gaps']}")
    print_table(results)
    for run, r in results.items():
        print(f"\n{r['report']}\ntimeline: {r['png']}")
        if len(r["kills"]) < args.kills:
            print(f"WARNING: the {run} run got {len(r['kills'])} of {args.kills} kills: run more --steps")
    res, naive, survivors = results[RESILIENT], results[NAIVE], results[SURVIVORS]
    goodput, naive_goodput = res["breakdown"].goodput, naive["breakdown"].goodput
    steady = res["breakdown"].step_time / res["breakdown"].total  # goodput with slow steps counted productive
    # A background write shares the CPUs with the training step here (on accelerators it would
    # not): it makes the resilient run's steps longer, and the ledger counts step time as productive.
    at_naive_step = res["breakdown"].steps_kept * naive["measured"].step_s / res["breakdown"].total
    print(f"\ngoodput / naive_goodput = {goodput / naive_goodput:.2f} (target >= 1.5); "
          f"|goodput - predicted| = {abs(goodput - res['predicted']):.3f} (target <= 0.05); the planner does not "
          f"model step-time deviation: with the slow steps counted productive {steady:.3f}, "
          f"|{steady:.3f} - predicted| = {abs(steady - res['predicted']):.3f}")
    print(f"wall time to train the same {args.steps} steps: naive / resilient = {naive['wall'] / res['wall']:.2f}; "
          f"resilient median step {res['measured'].step_s:.3f}s vs naive {naive['measured'].step_s:.3f}s "
          f"(background writes share the CPUs); resilient goodput counting its kept steps at the naive's "
          f"step time: {at_naive_step:.3f} ({at_naive_step / naive_goodput:.2f}x naive)")
    survivor_goodput = survivors["breakdown"].goodput
    print(f"survivor mode: goodput {survivor_goodput:.3f} ({survivor_goodput / goodput:.2f}x resilient), "
          f"{survivors['against_whole_group']:.3f} with its steps measured against the resilient run's reference "
          f"step, wall time for the same steps survivors / resilient = {survivors['wall'] / res['wall']:.2f}, "
          f"median step {survivors['measured'].step_s:.3f}s (gradients exchanged after the backward pass), "
          f"samples trained twice {survivors['twice']}, skipped {survivors['skipped']}")
    print(f"survivor_goodput={survivors['breakdown'].goodput:.3f}")
    print(f"goodput={goodput:.3f} naive_goodput={naive_goodput:.3f} predicted_goodput={res['predicted']:.3f} "
          f"naive_resampled={naive['twice'] + naive['skipped']}")


# --- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps of the job (default: 200)")
    parser.add_argument("--model", default="resnet18",
                        help='the job\'s model: a torchvision model name, on an image volume (default: resnet18, '
                             'the main job\'s); "mlp": an MLP of --state-mb on synthetic data')
    parser.add_argument("--state-mb", type=float, default=512,
                        help="with --model mlp, its training state, MiB: fp32 parameters + Adam moments (default: 512)")
    parser.add_argument("--image-size", type=int, default=32, help="training image side in pixels (default: 32)")
    parser.add_argument("--step-seconds", type=float, default=0.3,
                        help="emulated accelerator compute per step, before the real CPU step (default: 0.3)")
    parser.add_argument("--mtbf", type=float, default=60.0,
                        help="mean seconds between kills, also the planner's MTBF (default: 60)")
    parser.add_argument("--kills", type=int, default=4, help="worker kills, about one every --mtbf (default: 4)")
    parser.add_argument("--survivor-interval", type=int, default=50,
                        help="survivor mode's checkpoint interval, steps: its safety net for losing the whole job, "
                             "which no kill here does (default: 50, an epoch)")
    parser.add_argument("--samples", type=int, default=800,
                        help=f"samples per epoch: images, {CLASSES} classes (default: 800)")
    parser.add_argument("--global-batch", type=int, default=16, help="global batch size (default: 16)")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default: 2)")
    parser.add_argument("--node-cpus", type=int, default=2, help="CPUs of the worker node (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule, data and model (default: 0)")
    parser.add_argument("--timeout", type=float, default=900, help="give up on a run after this many s (default: 900)")
    parser.add_argument("--figures", type=Path, default=Path("goodput_chaos_figures"),
                        help="where the PNG timelines go (default: ./goodput_chaos_figures; the README's are "
                             "in docs/)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (Ray logs, ledgers, checkpoints)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    schedule = timed_kill_schedule(args.seed, args.mtbf, args.kills, args.workers)
    args.figures.mkdir(parents=True, exist_ok=True)
    with experiment_dir("goodput-chaos-", args.keep) as root:
        job = ChaosJob(seed=args.seed, samples=args.samples, global_batch=args.global_batch, max_steps=args.steps,
                       step_seconds=args.step_seconds, width=model_width(args.state_mb), square_layers=HIDDEN_LAYERS,
                       model=args.model, image_size=args.image_size, optimizer="adam", interval="auto",
                       mtbf_s=args.mtbf, kill_schedule=schedule)
        if args.model != "mlp":
            import pyarrow.fs as pafs

            volume = root / "volume"
            samples = make_image_volume(pafs.LocalFileSystem(), str(volume), classes=CLASSES,
                                        per_class=args.samples // CLASSES, size=args.image_size, seed=args.seed)
            job = replace(job, volume=str(volume), samples=samples)
        jobs = {RESILIENT: job, NAIVE: job, SURVIVORS: replace(job, interval=args.survivor_interval)}
        fits, foreign = {}, {}
        with chaos_cluster(root, args.node_cpus, import_dirs=[BENCHMARKS]) as cluster:
            for run in RUNS:
                started = time.monotonic()
                with foreign_cpu() as samples:  # spare workers come with the Checkpointer; the naive loop has none
                    fits[run] = fit_on(cluster, root, run, TRAIN_FNS[run], jobs[run], workers=args.workers,
                                       max_failures=len(schedule), timeout=args.timeout,
                                       spare_workers=run != NAIVE, survivors=run == SURVIVORS)
                foreign[run] = statistics.mean(samples) if samples else math.nan
                print(f"{run}: fit() took {time.monotonic() - started:.0f}s", flush=True)
        results = {run: analyse(run, fits[run], foreign[run], jobs[run], args) for run in (RESILIENT, NAIVE)}
        results[SURVIVORS] = analyse(SURVIVORS, fits[SURVIVORS], foreign[SURVIVORS], jobs[SURVIVORS], args,
                                     whole_group_step=results[RESILIENT]["breakdown"].reference_step_seconds)
        print_results(results, args, schedule, state_mib(job))


if __name__ == "__main__":
    main()
