"""Goodput under chaos: ray_resilient, its survivor mode and the naive checkpointing baseline, same job, same kills.

Setup
    One local multi-node Ray cluster (:class:`ray_resilient.testing.LocalRayCluster`: a head
    node with 0 CPUs plus one worker node with ``--node-cpus`` CPUs, default 2) runs three
    ``TorchTrainer.fit()`` calls, one after the other, each from its own driver subprocess through
    :func:`ray_resilient.recommended_ray_config` (``--workers`` CPU workers on gloo, health check
    every 0.5 s, ``max_failures`` = the kills scheduled) and ``ResilientRayConfig.fit`` (which
    records the driver's ``job_start`` in the run's goodput ledger). Storage is local disk.

    The job, the same in both runs: ``--steps`` steps (4 epochs of 50 global batches) of an MLP
    (32 -> 2529, then 7 square 2529 x 2529 layers, -> 4; fp32) with Adam: 44.9M parameters, so
    parameters plus Adam's two moments take 514 MiB (``--state-mb``, at least 512), wrapped in DDP
    by ``prepare_model``. A step is ``--step-seconds`` of ``time.sleep`` emulating accelerator
    compute, then one real forward/backward/``optimizer.step()`` on the rank's 8 samples of a
    16-sample global batch of ``SyntheticBatches`` (``ray_resilient.testing``: ``--samples`` 800, the
    order a pure function of (seed, epoch)); DDP all-reduces 171 MiB of gradients a step over gloo.

    Kills: ``--kills`` (4) in one seeded schedule for every run, in wall-clock time from ``fit()``:
    gaps drawn uniformly from [0.75, 1.25] x ``--mtbf`` (60 s), each of a random rank. A rank
    checks after each step whether its next kill is due and then SIGKILLs itself (a marker file in
    the run dir makes each kill fire once per run), so both runs lose workers at the same moments
    of their run, as failures arrive in wall-clock time. (A schedule in steps would hand the slower
    run fewer failures per hour.) The count is fixed so that the naive run finishes: it needs an
    epoch without a failure to get past one. Every kill makes Ray Train restart the whole worker
    group, except in survivor mode.

The three runs
    resilient  ``Checkpointer(interval_steps="auto", mtbf_s=60)``: sharded asynchronous DCP
               checkpoints (each rank stages its half of the replicated state, a background thread
               writes it), registered with Ray once durable; restore of the newest complete
               checkpoint with the exact data position; spare worker processes for the next
               restart (``recommended_ray_config``'s default). The interval: first save after 10
               steps, then after every save Daly's interval from the measured stall and step time.
    naive      what most teams write first: rank 0 ``torch.save``s model + optimizer
               ``state_dict()`` into a temp dir, every rank calls ``ray.train.report(checkpoint=...)``
               with the default SYNC upload (Ray copies the directory into the run storage before
               returning); restore: every rank ``torch.load``s ``ray.train.get_checkpoint()``; no
               spare workers. The interval follows the same rule as the checkpointer's "auto", so
               neither run is handicapped by a badly chosen interval. Its step is its position in
               the data (epoch x batches per epoch + batch, as a plain ``for epoch ...: for batch
               in loader`` loop counts it); after a restore its data starts over at the first batch
               of the checkpoint's epoch, as a plain ``DataLoader`` does, so the positions since
               then are trained again (the ledger counts their first run as wasted: a step number
               recorded again). Its train function records the same ledger events as the checkpointer
               does (``attempt_start``, ``restore``, ``step``, ``save``, ``finish``).
    survivors  ``recommended_ray_config(..., survivors=True)`` and ``SurvivingReplicas``: each worker
               a whole replica (no DDP), the global batch cut into ``--workers`` micro-batches of 8
               (each ``--step-seconds`` of emulated compute plus a real forward/backward), each
               micro-batch's gradient a row of one gloo all-gather (at 2 workers 171 MiB each way,
               as DDP's all-reduce, but after the backward pass instead of overlapped with it). A kill makes the survivor drop the step in flight and train it again
               alone (both micro-batches); Ray replaces only the dead worker, which copies the
               state from the survivor and joins at a step boundary. The lead saves a plain DCP
               checkpoint every ``--survivor-interval`` steps (50: the safety net for losing the
               whole job, which no kill here does). Spare workers as in the resilient run.

Measurement
    Goodput and its breakdown come from each run's ledger (``ray_resilient.goodput.account``),
    the planner's inputs from ``measured_inputs`` (median save stall, median restart, median kept
    step). The interval a run checkpointed at is the last gap between two consecutive saves of
    an attempt (the first save after a start and the final save excluded). The prediction is the
    planner's ``expected_goodput(interval_steps x step_s, save_stall, restart, mtbf=60)``.
    Resampling: every rank logs the sample ids of each step; over the steps the final model was
    trained on (those no later attempt restored a checkpoint older than), (epoch, sample id) pairs
    seen more often than in an uninterrupted run are "trained twice", pairs it would have seen
    and never were are "skipped"; ``naive_resampled`` is their sum (for the resilient run both 0).
    In survivor mode a step's kept micro-batches are those of the membership that went on from
    it, and the planner's prediction does not apply (no restarts); instead, per kill, the
    survivor's ``pause``: from its commit of the killed replica's last step to its commit of the
    next one, minus the median step. The PNG timelines are
    ``ray_resilient.goodput.report.render_report``'s.

Machine
    A 2-core AMD EPYC Firecracker VM, 24 GiB RAM, torch CPU, Ray 2.60 (Train V2), shared with
    other users' jobs. The two workers, Ray's processes and the background checkpoint writes
    share the 2 cores: unlike on accelerators, an asynchronous write slows the training steps it
    overlaps, and the ledger counts step time as productive, so the table also shows both runs'
    median step and the wall time each needed for the same steps.

Result (defaults, ``--seed 0``, 2026-11-29; other users' processes used 0.01 cores): the table
    and both timelines are in ``docs/goodput_chaos.md``. In short: goodput 0.812 against 0.418
    (ratio 1.94, target 1.5: met), predicted 0.856 (|difference| 0.044, target 0.05: met). The
    naive run lost 34.0% of its wall time to 166 steps trained again (each restore went back to
    the start of an epoch) and 11.3% to 2.0 s save stalls; ray_resilient 2.6% and 2.3%. Restarts:
    5.9 s against 9.2 s (median; spare workers). Caveat of 2 cores: ray_resilient's background
    writes slow its steps (median 0.922 s against 0.809 s), which the ledger counts as
    productive; the wall time for the same 200 steps is naive / resilient = 1.64.

The last line printed is the summary the issue asks for::

    goodput=<x> naive_goodput=<y> predicted_goodput=<z> naive_resampled=<count>

Survivor mode (2026-12-01, a slower day: the resilient run's steps took 1.59 s, its restarts
    19 s): goodput 0.916 against the resilient run's 0.722 and the naive run's 0.454, one attempt
    for 4 kills, 4 steps recomputed, a median pause of 2.47 s, no sample lost or repeated; but its
    step is 1.69x slower on 2 cores (gradients exchanged after the backward pass, fresh buffers
    every step), so the same steps took 1.33x the wall time (``docs/goodput_chaos.md``).

Run: ``python benchmarks/goodput_chaos.py`` (about 18 minutes on a quiet machine; ``--steps 60
--state-mb 64 --mtbf 25`` for a quick try of the mechanics). The PNG timelines go to
``--figures`` (default ``docs/``); ``docs/goodput_chaos.md`` shows the run above.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray_resilient.checkpoint.save_policy import AUTO_FIRST_STEPS
from ray_resilient.goodput.events import EventKind

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
DATA_MODULE = "ray_resilient.testing.synthetic_data"

RESILIENT, NAIVE, SURVIVORS = "resilient", "naive", "survivors"
RUNS = (RESILIENT, NAIVE, SURVIVORS)
HIDDEN_LAYERS = 7  # square hidden Linear layers; their width sets the state size
ADAM_BYTES_PER_PARAM = 12  # fp32 parameter + Adam's two fp32 moments
STEP_TIMES_KEPT = 50  # as Checkpointer: the step time is the median of the last 50
NAIVE_STATE_FILE = "state.pt"
KERNEL_THREADS = 2  # kthreadd, the parent of every kernel thread


# --- inside the Ray workers (they import this module as `goodput_chaos`) -------------------------


def model_width(state_mb: float) -> int:
    """The hidden width at which :func:`build_model`'s state takes at least ``state_mb`` MiB."""
    return math.ceil(math.sqrt(state_mb * 2**20 / ADAM_BYTES_PER_PARAM / HIDDEN_LAYERS))


def state_mib(width: int) -> float:
    """fp32 parameters + Adam's two moments of :func:`build_model` at ``width``, MiB."""
    from ray_resilient.testing.synthetic_data import CLASSES, FEATURES

    params = (FEATURES + 1) * width + HIDDEN_LAYERS * (width + 1) * width + (width + 1) * CLASSES
    return params * ADAM_BYTES_PER_PARAM / 2**20


def build_model(state_mb: float) -> Any:
    """An MLP (32 features -> HIDDEN_LAYERS square layers -> 4 classes) whose fp32 parameters plus
    Adam's two moments take at least ``state_mb`` MiB."""
    import torch
    from ray_resilient.testing.synthetic_data import CLASSES, FEATURES

    width = model_width(state_mb)
    layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, width), torch.nn.ReLU()]
    for _ in range(HIDDEN_LAYERS):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, CLASSES))
    return torch.nn.Sequential(*layers)


def unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


class RankLog:
    """This attempt's record of one rank: the restored step, the sample ids of every step, the kill.

    One file per process (``<run>-rank<r>-<pid>.jsonl``), one JSON object a line, flushed at once,
    so a SIGKILL loses nothing already logged.
    """

    def __init__(self, record_dir: str, run: str, rank: int):
        self._file = open(Path(record_dir) / f"{run}-rank{rank}-{os.getpid()}.jsonl", "a")

    def __call__(self, **fields: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), **fields}) + "\n")
        self._file.flush()


class TimedKills:
    """SIGKILLs this rank at its planned moments of the run's wall clock, each once per run.

    ``schedule`` is a list of (seconds after ``t0``, rank); a kill fires at the end of the first
    step of this rank that ends after its moment (kills land between steps, like the ``step``
    faults of :mod:`ray_resilient.faults`). A marker file, created atomically before the kill,
    makes the restarted attempt go past it.
    """

    def __init__(self, schedule: list[list[float]], t0: float, rank: int, marker_dir: str, log: RankLog):
        os.makedirs(marker_dir, exist_ok=True)
        self.t0, self.log, self.marker_dir = t0, log, marker_dir
        self.pending = [(at, index) for index, (at, kill_rank) in enumerate(schedule)
                        if kill_rank == rank and not os.path.exists(self._marker(index))]

    def _marker(self, index: int) -> str:
        return os.path.join(self.marker_dir, f"kill-{index}")

    def check(self, step: int) -> None:
        if not self.pending or time.time() - self.t0 < self.pending[0][0]:
            return
        at, index = self.pending.pop(0)
        try:
            os.close(os.open(self._marker(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        self.log(kill=index, step=step, planned=at)
        os.kill(os.getpid(), signal.SIGKILL)


class Job:
    """What the runs share: the model, the optimizer, the data, the step and the kills.

    ``replica=True`` (survivor mode): the model is not wrapped in DDP (``SurvivingReplicas`` reduces
    the gradients) and the data serves micro-batches of the whole global batch.
    """

    def __init__(self, config: dict[str, Any], run: str, replica: bool = False):
        import ray.train
        import torch
        from ray.train.torch import prepare_model
        from ray_resilient.testing.synthetic_data import SyntheticBatches

        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.storage = context.get_storage()
        self.config = config
        self.log = RankLog(config["record_dir"], run, self.rank)
        torch.manual_seed(config["seed"])
        model = build_model(config["state_mb"])
        self.model = model if replica else prepare_model(model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.data = SyntheticBatches(config["samples"], config["global_batch"], config["seed"],
                                     *((0, 1) if replica else (self.rank, self.world)))
        self.epochs = math.ceil(config["max_steps"] / self.data.batches_per_epoch) + 1
        self.kills = TimedKills(config["schedule"], config["t0"], self.rank,
                                f"{self.storage.experiment_fs_path}/.chaos", self.log)

    def train_step(self, x: Any, y: Any) -> None:
        """The emulated accelerator compute, then one real forward/backward/Adam step (DDP all-reduce)."""
        import torch

        time.sleep(self.config["step_seconds"])
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def train(self, epoch: int, step: int, step_completed: Callable[[int, int], None]) -> tuple[int, int]:
        """Train from ``epoch`` (the data already positioned) until ``max_steps``: each step is logged,
        handed to ``step_completed(step, epoch)``, then checked for a due kill. Returns (step, epoch)."""
        for epoch in range(epoch, self.epochs):
            if step >= self.config["max_steps"]:
                break
            for ids, x, y in self.data:
                self.train_step(x, y)
                step += 1
                self.log(step=step, epoch=epoch, ids=ids.tolist())
                step_completed(step, epoch)
                self.kills.check(step)
                if step >= self.config["max_steps"]:
                    break
        return step, epoch


def train_resilient(config: dict[str, Any]) -> None:
    """ray_resilient: sharded async DCP checkpoints at the planner's interval, exact data position."""
    job = Job(config, RESILIENT)
    from ray_resilient import Checkpointer

    with Checkpointer(job.model, job.optimizer, data=job.data, interval_steps="auto", mtbf_s=config["mtbf_s"],
                      seed=config["seed"], faults="", goodput_logger=None) as ckpt:
        state = ckpt.restore()
        job.log(restored=state.step, epoch=state.epoch, consumed=job.data.consumed)
        step, _ = job.train(state.epoch, state.step, lambda _step, epoch: ckpt.step_completed(epoch))
        ckpt.finish()
    job.log(finished=step)


def train_survivors(config: dict[str, Any]) -> None:
    """Survivor mode: each worker a whole replica; the global batch in ``world`` micro-batches, each
    ``--step-seconds`` of emulated compute plus a real forward/backward. A kill drops the step in
    flight on the others, which train it again without the dead replica; its replacement copies the
    state from a live one. The lead saves a DCP checkpoint every ``survivor_interval`` steps (the
    safety net for losing the whole job)."""
    import torch

    from ray_resilient.survivors import SurvivingReplicas

    job = Job(config, SURVIVORS, replica=True)
    parts, per_epoch = job.world, job.data.batches_per_epoch
    computed: dict[int, list[int]] = {}

    def loss_of(step: int, part: int) -> torch.Tensor:
        ids, x, y = job.data.micro_batch(step, part, parts)
        computed[part] = ids.tolist()
        time.sleep(config["step_seconds"])
        return torch.nn.functional.cross_entropy(job.model(x), y)

    with SurvivingReplicas(job.model, job.optimizer, micro_batches=parts, seed=config["seed"],
                           checkpoint_interval=config["survivor_interval"]) as replicas:
        job.log(joined=replicas.step)
        while replicas.step < config["max_steps"]:
            computed.clear()
            replicas.train_step(loss_of)
            job.log(step=replicas.step, epoch=(replicas.step - 1) // per_epoch, members=list(replicas.members),
                    parts={k: computed[k] for k in replicas.last_parts})
            job.kills.check(replicas.step)
    job.log(finished=replicas.step)


class NaiveCheckpoints:
    """The checkpointing most teams write first, recording the same goodput ledger as ray_resilient.

    Rank 0 ``torch.save``s the whole model and optimizer ``state_dict()`` into a temp dir and every
    rank calls ``ray.train.report(checkpoint=...)`` with the default SYNC upload (Ray copies the
    directory into the run storage before returning); the temp dir is then removed. The loop
    stalls for all of it. Restore: every rank ``torch.load``s the checkpoint Ray hands back.

    The interval follows the same rule as ``Checkpointer(interval_steps="auto")``: the first
    save :data:`AUTO_FIRST_STEPS` steps after the start or restore, then after every save Daly's
    interval from rank 0's last save stall and median step time (broadcast, so every rank reports
    at the same step).
    """

    def __init__(self, job: Job):
        from ray_resilient.goodput.ledger import LedgerWriter
        from ray_resilient.storage import RunStorage

        self.job = job
        self.mtbf_s = job.config["mtbf_s"]
        self.ledger = None
        if job.rank == 0:
            # local_dir is only used for remote storage (a spool file); the run storage here is local
            self.ledger = LedgerWriter(RunStorage(job.storage.storage_filesystem, job.storage.experiment_fs_path,
                                                  os.path.join(tempfile.gettempdir(), "goodput-chaos-ledger")), 0)
            self.ledger.record(EventKind.ATTEMPT_START, world_size=job.world)
        self.interval = AUTO_FIRST_STEPS
        self.next_save = AUTO_FIRST_STEPS
        self.step_times: list[float] = []
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
            unwrap(self.job.model).load_state_dict(state["model"])
            self.job.optimizer.load_state_dict(state["optimizer"])
            saved = self.last_saved = state["step"]
        per_epoch = self.job.data.batches_per_epoch
        resumed = saved // per_epoch * per_epoch
        self.next_save = resumed + self.interval
        self.mark = time.time()
        self.record(EventKind.RESTORE, t=self.mark, t_start=started, step=resumed)
        return saved, resumed

    def step_completed(self, step: int, epoch: int) -> None:
        ended = time.time()
        self.record(EventKind.STEP, t=ended, step=step, t_start=self.mark, data_wait=0.0)
        self.step_times = (self.step_times + [ended - self.mark])[-STEP_TIMES_KEPT:]
        self.mark = ended
        if step >= self.next_save:
            stall = self.save(step, epoch)
            self.update_interval(step, stall)
        self.mark = time.time()

    def save(self, step: int, epoch: int) -> float:
        """torch.save on rank 0 + synchronous report; returns the stall (s)."""
        import ray.train
        import torch
        from ray.train import Checkpoint

        started, wall_started = time.monotonic(), time.time()
        directory, checkpoint = None, None
        if self.job.rank == 0:
            directory = tempfile.mkdtemp(prefix="naive-checkpoint-")
            torch.save({"model": unwrap(self.job.model).state_dict(), "optimizer": self.job.optimizer.state_dict(),
                        "step": step, "epoch": epoch}, os.path.join(directory, NAIVE_STATE_FILE))
            checkpoint = Checkpoint.from_directory(directory)
        ray.train.report({"step": step, "epoch": epoch}, checkpoint=checkpoint)
        self.record(EventKind.DURABLE, step=step)  # Ray's SYNC upload returned: copied into the run storage (no fsync)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        self.last_saved = step
        self.record(EventKind.SAVE, t=time.time(), step=step, t_start=wall_started)
        return time.monotonic() - started

    def update_interval(self, step: int, stall: float) -> None:
        import torch.distributed as dist

        from ray_resilient.goodput.planner import interval_steps_for

        box = [(stall, statistics.median(self.step_times))]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        stall, step_s = box[0]
        self.interval = interval_steps_for(self.mtbf_s, max(stall, 1e-6), max(step_s, 1e-6))
        self.next_save = step + self.interval

    def finish(self, step: int, epoch: int) -> None:
        if self.last_saved != step:
            self.save(step, epoch)
        self.record("finish", step=step)
        if self.ledger is not None:
            self.ledger.close()


def train_naive(config: dict[str, Any]) -> None:
    """The naive baseline: rank-0 torch.save + SYNC report at the planner's interval. Its step is its
    position in the data (epoch x batches per epoch + batch), as a plain ``for epoch ...: for batch in
    loader`` loop counts it; after a restore the data starts over at the first batch of the
    checkpoint's epoch (what a plain ``DataLoader`` does), so the batches since then are trained again."""
    job = Job(config, NAIVE)
    ckpt = NaiveCheckpoints(job)
    saved, step = ckpt.restore()
    start_epoch = step // job.data.batches_per_epoch
    job.data.load_state_dict({"epoch": start_epoch, "consumed": 0})
    job.log(restored=saved, resumed=step, epoch=start_epoch, consumed=0)
    step, epoch = job.train(start_epoch, step, ckpt.step_completed)
    ckpt.finish(step, epoch)
    job.log(finished=step)


def drive(config: dict[str, Any]) -> dict[str, Any]:
    """The driver of one run (:func:`ray_resilient.testing.run_driver`, which imports this module as
    ``goodput_chaos``, so the workers import the train functions too): one ``fit()``; its times and error."""
    import ray
    from ray.train.torch import TorchTrainer

    from ray_resilient import recommended_ray_config
    from ray_resilient.spare_workers import DEFAULT_PRELOAD_MODULES

    ray.init(address=config["address"])
    # Spare workers come with ray_resilient's Checkpointer; the naive loop has none.
    ray_config = recommended_ray_config(config["run"], config["storage"], workers=config["workers"],
                                        max_failures=config["max_failures"], spare_workers=config["run"] != NAIVE,
                                        preload=(*DEFAULT_PRELOAD_MODULES, DATA_MODULE, "goodput_chaos"),
                                        survivors=config["run"] == SURVIVORS)
    train_fn = {RESILIENT: train_resilient, NAIVE: train_naive, SURVIVORS: train_survivors}[config["run"]]
    loop = {**config["loop"], "t0": time.time()}  # the kill schedule's clock starts with fit()
    trainer = TorchTrainer(train_fn, train_loop_config=loop, **ray_config.trainer_kwargs())
    outcome: dict[str, Any] = {"t0": loop["t0"]}
    try:
        result = ray_config.fit(trainer)
        outcome.update(error=repr(result.error) if result.error else None)
    except Exception as err:  # noqa: BLE001 - reported by the parent process
        outcome.update(error=repr(err))
    outcome["fit_end"] = time.time()
    ray.shutdown()
    return outcome


# --- the kill schedule ------------------------------------------------------------------------------


def kill_schedule(seed: int, mtbf_s: float, kills: int, world_size: int) -> list[list[float]]:
    """``kills`` seeded kills about one every ``mtbf_s`` of wall clock: gaps uniform in
    [0.75, 1.25] x mtbf_s, each of a random rank, as (seconds after the run's start, rank)."""
    rng = random.Random(seed)
    schedule, at = [], 0.0
    for _ in range(kills):
        at += rng.uniform(0.75 * mtbf_s, 1.25 * mtbf_s)
        schedule.append([round(at, 1), rng.randrange(world_size)])
    return schedule


# --- analysis ---------------------------------------------------------------------------------------


def read_rank_logs(record_dir: Path, run: str) -> dict[int, list[list[dict[str, Any]]]]:
    """Per rank, its attempts' records (each a list of lines), in start order."""
    logs: dict[int, list[list[dict[str, Any]]]] = {}
    for path in sorted(record_dir.glob(f"{run}-rank*-*.jsonl")):
        rank = int(path.name[len(run) + 5:].split("-")[0])
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if lines:
            logs.setdefault(rank, []).append(lines)
    for attempts in logs.values():
        attempts.sort(key=lambda lines: lines[0]["t"])
    return logs


def kept_samples(attempts: list[list[dict[str, Any]]]) -> Counter:
    """(epoch, sample id) of every step of one rank that the final model was trained on: a step is
    lost when a later attempt restored a checkpoint older than it. (The naive run's steps between
    the start of the checkpoint's epoch and the checkpoint are in the model and then trained again.)"""
    # An attempt that died before its restore redid nothing.
    restored = [next((line["restored"] for line in lines if "restored" in line), math.inf) for lines in attempts]
    seen: Counter = Counter()
    for index, lines in enumerate(attempts):
        lost_after = min(restored[index + 1:], default=math.inf)
        for line in lines:
            if "ids" in line and line["step"] <= lost_after:
                seen.update((line["epoch"], i) for i in line["ids"])
    return seen


def survivor_kept_samples(processes: list[list[dict[str, Any]]]) -> Counter:
    """(epoch, sample id) of every committed step of survivor mode that the run kept: a step's kept
    micro-batches are those logged by the processes of the membership that went on from it (a
    step dropped and trained again by fewer replicas keeps only the second try)."""
    last: dict[int, float] = {}
    by_step: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for process, lines in enumerate(processes):
        for line in lines:
            if "parts" in line:
                by_step.setdefault(line["step"], []).append((process, line))
                last[process] = max(last.get(process, 0), line["step"])
            if "finished" in line:
                last[process] = math.inf
    seen: Counter = Counter()
    for step, records in by_step.items():
        went_on = {tuple(line["members"]) for process, line in records if last[process] > step}
        if len(went_on) != 1:  # nobody carried this step on (or they disagree): none of it is kept
            continue
        for _, line in records:
            if tuple(line["members"]) in went_on:
                seen.update((line["epoch"], i) for ids in line["parts"].values() for i in ids)
    return seen


def expected_samples(args: argparse.Namespace) -> Counter:
    """(epoch, sample id) of an uninterrupted run of ``args.steps`` steps."""
    from ray_resilient.testing.synthetic_data import SyntheticBatches

    data = SyntheticBatches(args.samples, args.global_batch, args.seed, 0, 1)  # one rank: whole global batches
    expected: Counter = Counter()
    step = 0
    while step < args.steps:
        epoch = data.epoch
        for ids, _x, _y in data:
            expected.update((epoch, i) for i in ids.tolist())
            step += 1
            if step >= args.steps:
                break
    return expected


def resampled(record_dir: Path, run: str, args: argparse.Namespace) -> tuple[int, int]:
    """(samples trained again within an epoch, samples of the run's data budget never trained) over
    the kept steps of every rank, against an uninterrupted run."""
    logs = read_rank_logs(record_dir, run)
    if run == SURVIVORS:  # which steps were kept is decided across the replicas
        seen = survivor_kept_samples([lines for attempts in logs.values() for lines in attempts])
    else:
        seen = sum((kept_samples(attempts) for attempts in logs.values()), Counter())
    expected = expected_samples(args)
    return sum((seen - expected).values()), sum((expected - seen).values())


def kills_fired(record_dir: Path, run: str, t0: float) -> list[dict[str, Any]]:
    kills = [line for attempts in read_rank_logs(record_dir, run).values() for lines in attempts
             for line in lines if "kill" in line]
    return [{"at": k["t"] - t0, "planned": k["planned"], "step": k["step"]}
            for k in sorted(kills, key=lambda k: k["t"])]


def survivor_pauses(logs: dict[int, list[list[dict[str, Any]]]], step_s: float) -> list[float]:
    """Per kill in survivor mode: on the slowest survivor, the time from its commit of the killed
    replica's last step to its commit of the next one, minus the median step."""
    processes = [lines for attempts in logs.values() for lines in attempts]
    committed = [{line["step"]: line["t"] for line in lines if "parts" in line} for lines in processes]
    pauses = []
    for killed, lines in enumerate(processes):
        for kill in (line for line in lines if "kill" in line):
            gaps = [times[kill["step"] + 1] - times[kill["step"]] for other, times in enumerate(committed)
                    if other != killed and kill["step"] in times and kill["step"] + 1 in times]
            if gaps:
                pauses.append(max(gaps) - step_s)
    return pauses


def steady_intervals(events: list[dict[str, Any]]) -> list[int]:
    """Steps between consecutive saves of rank 0 within an attempt, without the first save of an
    attempt (AUTO_FIRST_STEPS after its start) and the final save (at the last step)."""
    from ray_resilient.goodput.accounting import group_attempts

    gaps = []
    for attempt in group_attempts(events)[0]:
        saves = [e["step"] for e in attempt.events if e["kind"] == "save"]
        if attempt.finished:
            saves = saves[:-1]
        gaps += [b - a for a, b in zip(saves, saves[1:])]
    return gaps


def analyse(run: str, root: Path, args: argparse.Namespace, outcome: dict[str, Any], figures: Path) -> dict[str, Any]:
    """The measured and predicted goodput of one run, its breakdown, its timeline (PNG) and report."""
    from ray_resilient.goodput.accounting import account, group_attempts
    from ray_resilient.goodput.ledger import load_events
    from ray_resilient.goodput.planner import expected_goodput, interval_steps_for, measured_inputs
    from ray_resilient.goodput.report import render_report

    run_dir = str(root / "storage" / run)
    events = load_events(run_dir)
    breakdown = account(events)
    measured = measured_inputs(run_dir)
    gaps = steady_intervals(events)
    interval_steps = gaps[-1] if gaps else math.nan  # the final interval the run checkpointed at
    interval_s = interval_steps * measured.step_s
    restart = measured.restart_s or 0.0
    twice, skipped = resampled(root / "record", run, args)
    png = figures / f"goodput_chaos_{run}.png"
    report = render_report(run_dir, str(png))
    attempts, job_starts = group_attempts(events)
    first_start = attempts[0].first_work() - min([attempts[0].start, *job_starts])
    restart_mean = statistics.mean(breakdown.restarts) if breakdown.restarts else 0.0
    kills = kills_fired(root / "record", run, outcome["t0"])
    result = {
        "run": run, "breakdown": breakdown, "measured": measured, "gaps": gaps,
        "interval_steps": interval_steps, "interval_s": interval_s, "first_start": first_start,
        "twice": twice, "skipped": skipped, "kills": kills,
        "wall": outcome["fit_end"] - outcome["t0"], "foreign_cpu": outcome["foreign_cpu"], "report": report, "png": png,
    }
    if run == SURVIVORS:  # no restarts: the planner's model does not apply
        pauses = survivor_pauses(read_rank_logs(root / "record", run), measured.step_s)
        return {**result, "pause": statistics.median(pauses) if pauses else math.nan, "planner_steps": None,
                "restart": None, "restart_mean": None, "predicted": None, "predicted_run": None}
    return {
        **result, "pause": None, "restart": restart, "restart_mean": restart_mean,
        "planner_steps": interval_steps_for(args.mtbf, measured.save_stall_s, measured.step_s),
        "predicted": expected_goodput(interval_s, measured.save_stall_s, restart, args.mtbf),
        # the planner's G with the mean restart, scaled by the share of the run after its first start
        "predicted_run": expected_goodput(interval_s, measured.save_stall_s, restart_mean, args.mtbf)
        * (1 - first_start / breakdown.total),
    }


def print_results(results: dict[str, dict[str, Any]], args: argparse.Namespace, schedule: list[list[float]],
                  state_size_mib: float) -> None:
    from ray_resilient.goodput.accounting import PARTS

    print(f"\nGoodput under chaos: {args.steps} steps of a {state_size_mib:.0f} MiB training state (fp32 MLP + Adam), "
          f"{args.workers} workers, {args.step_seconds}s emulated compute + a real DDP step each; kills about one "
          f"every {args.mtbf:.0f}s of wall clock (MTBF given to the planner: {args.mtbf:.0f}s)")
    print("kill schedule (s after fit() started, rank): "
          + ", ".join(f"{at:.0f}s/r{rank}" for at, rank in schedule[:8]) + (" ..." if len(schedule) > 8 else ""))
    for run, r in results.items():
        print(f"  {run}: kills at " + ", ".join(f"{k['at']:.0f}s (step {k['step']})" for k in r["kills"])
              + f"; steady save gaps (steps): {r['gaps']}")
    rows: list[tuple[str, ...]] = []

    def row(label: str, fmt: str, key) -> None:
        """One line of the table; a value of None (does not apply to that run) shows as "-"."""
        rows.append((label, *("-" if key(results[run]) is None else fmt.format(key(results[run])) for run in RUNS)))

    row("wall time of fit() (s)", "{:.1f}", lambda r: r["wall"])
    row("other users' CPU use, mean (cores of 2)", "{:.2f}", lambda r: r["foreign_cpu"])
    row("kills / attempts", "{}", lambda r: f"{len(r['kills'])} / {r['breakdown'].attempts}")
    row("checkpoint interval (steps)", "{}", lambda r: r["interval_steps"])
    row("checkpoint interval (s)", "{:.2f}", lambda r: r["interval_s"])
    row("planner's interval from measured (steps)", "{}", lambda r: r["planner_steps"])
    row("save stall, median (s)", "{:.3f}", lambda r: r["measured"].save_stall_s)
    row("restart, median (s)", "{:.2f}", lambda r: r["restart"])
    row("restart, mean (s)", "{:.2f}", lambda r: r["restart_mean"])
    row("survivors' pause after a kill, median (s)", "{:.2f}", lambda r: r["pause"])
    row("job's first start (s)", "{:.2f}", lambda r: r["first_start"])
    row("step time, median (s)", "{:.3f}", lambda r: r["measured"].step_s)
    row("steps recomputed", "{}", lambda r: r["breakdown"].steps_recomputed)
    row("measured goodput", "{:.3f}", lambda r: r["breakdown"].goodput)
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
    for run, r in results.items():
        print(f"\n{r['report']}\ntimeline: {r['png']}")
    res, naive = results[RESILIENT], results[NAIVE]
    goodput, naive_goodput = res["breakdown"].goodput, naive["breakdown"].goodput
    for run, r in results.items():
        if len(r["kills"]) < args.kills:
            print(f"WARNING: the {run} run got {len(r['kills'])} of {args.kills} kills: run more --steps")
    # A background write shares the CPUs with the training step here (on accelerators it would
    # not): it makes the resilient run's steps longer, and the ledger counts step time as productive.
    at_naive_step = res["breakdown"].steps_kept * naive["measured"].step_s / res["breakdown"].total
    print(f"\ngoodput / naive_goodput = {goodput / naive_goodput:.2f} (target >= 1.5); "
          f"|goodput - predicted| = {abs(goodput - res['predicted']):.3f} (target <= 0.05)")
    print(f"wall time to train the same {args.steps} steps: naive / resilient = {naive['wall'] / res['wall']:.2f}; "
          f"resilient median step {res['measured'].step_s:.3f}s vs naive {naive['measured'].step_s:.3f}s "
          f"(background writes share the CPUs); resilient goodput counting its kept steps at the naive's "
          f"step time: {at_naive_step:.3f} ({at_naive_step / naive_goodput:.2f}x naive)")
    survivors = results[SURVIVORS]
    print(f"survivor mode: goodput {survivors['breakdown'].goodput:.3f} ({survivors['breakdown'].goodput / goodput:.2f}x "
          f"resilient), wall time for the same steps survivors / resilient = {survivors['wall'] / res['wall']:.2f}, "
          f"median step {survivors['measured'].step_s:.3f}s (gradients exchanged after the backward pass), "
          f"samples trained twice {survivors['twice']}, skipped {survivors['skipped']}")
    print(f"survivor_goodput={survivors['breakdown'].goodput:.3f}")
    print(f"goodput={goodput:.3f} naive_goodput={naive_goodput:.3f} predicted_goodput={res['predicted']:.3f} "
          f"naive_resampled={naive['twice'] + naive['skipped']}")


# --- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps of the job (default: 200)")
    parser.add_argument("--state-mb", type=float, default=512,
                        help="training state, MiB: fp32 parameters + Adam moments (default: 512)")
    parser.add_argument("--step-seconds", type=float, default=0.3,
                        help="emulated accelerator compute per step, before the real CPU step (default: 0.3)")
    parser.add_argument("--mtbf", type=float, default=60.0,
                        help="mean seconds between kills, also the planner's MTBF (default: 60)")
    parser.add_argument("--kills", type=int, default=4, help="worker kills, about one every --mtbf (default: 4)")
    parser.add_argument("--survivor-interval", type=int, default=50,
                        help="survivor mode's checkpoint interval, steps: its safety net for losing the whole job, "
                             "which no kill here does (default: 50, an epoch)")
    parser.add_argument("--samples", type=int, default=800, help="synthetic samples per epoch (default: 800)")
    parser.add_argument("--global-batch", type=int, default=16, help="global batch size (default: 16)")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default: 2)")
    parser.add_argument("--node-cpus", type=int, default=2, help="CPUs of the worker node (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule, data and model (default: 0)")
    parser.add_argument("--timeout", type=float, default=900, help="give up on a run after this many s (default: 900)")
    parser.add_argument("--figures", type=Path, default=REPO / "docs",
                        help="where the PNG timelines go (default: docs/)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (Ray logs, ledgers, checkpoints)")
    return parser.parse_args(argv)


def process_cpu() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used so far) of every process on the machine (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        found[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    return found


def sample_foreign_cpu(samples: list[float], done: threading.Event, every_s: float = 2.0) -> None:
    """Cores' worth of CPU used by user processes that are not this benchmark's (not descendants
    of this process: the cluster's nodes, Ray's workers, the driver), every ``every_s`` until ``done``.

    Other users' work on a shared machine slows process start-up and steps alike; this says how
    much of it each run met. A process that started and exited between two samples is missed.
    """
    before = process_cpu()
    while not done.wait(every_s):
        now = process_cpu()
        mine = {os.getpid(), KERNEL_THREADS}  # kernel threads (e.g. page writeback) count for nobody
        changed = True
        while changed:
            changed = False
            for pid, (parent, _) in now.items():
                if pid not in mine and parent in mine:
                    mine.add(pid)
                    changed = True
        used = sum(cpu - before.get(pid, (0, 0.0))[1] for pid, (_, cpu) in now.items() if pid not in mine)
        samples.append(max(0.0, used) / every_s)
        before = now


def run_once(run: str, root: Path, args: argparse.Namespace, cluster: Any,
             schedule: list[list[float]]) -> dict[str, Any]:
    """One ``fit()`` of ``run`` in a driver subprocess; its outcome (start time, end time, error)."""
    from ray_resilient.testing import run_driver

    config = {
        "run": run, "address": cluster.address, "storage": str(root / "storage"), "workers": args.workers,
        "max_failures": len(schedule),
        "loop": {"record_dir": str(root / "record"), "schedule": schedule, "seed": args.seed, "mtbf_s": args.mtbf,
                 "state_mb": args.state_mb, "max_steps": args.steps, "step_seconds": args.step_seconds,
                 "samples": args.samples, "global_batch": args.global_batch,
                 "survivor_interval": args.survivor_interval},
    }
    started = time.monotonic()
    foreign: list[float] = []
    done = threading.Event()
    sampler = threading.Thread(target=sample_foreign_cpu, args=(foreign, done), daemon=True)
    sampler.start()
    try:
        outcome = run_driver("goodput_chaos:drive", config, env=cluster.env, workdir=root, timeout=args.timeout,
                             name=f"driver-{run}")
    finally:
        done.set()
        sampler.join()
    outcome["foreign_cpu"] = statistics.mean(foreign) if foreign else math.nan
    print(f"{run}: fit() took {time.monotonic() - started:.0f}s, error: {outcome.get('error')}", flush=True)
    if outcome.get("error"):
        raise RuntimeError(f"the {run} run failed: {outcome['error']}; see {root / f'driver-{run}.log'}")
    return outcome


def main() -> None:
    args = parse_args()
    from ray_resilient.testing import LocalRayCluster

    schedule = kill_schedule(args.seed, args.mtbf, args.kills, args.workers)
    root = Path(tempfile.mkdtemp(prefix="goodput-chaos-"))
    (root / "ray").mkdir()
    (root / "record").mkdir()
    args.figures.mkdir(parents=True, exist_ok=True)
    # The driver and the workers import this module (drive, the train functions) through PYTHONPATH.
    pythonpath = os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
    try:
        outcomes = {}
        with LocalRayCluster(root / "ray", env={**os.environ, "PYTHONPATH": pythonpath}) as cluster:
            cluster.add_node(cpus=args.node_cpus)
            for run in RUNS:
                outcomes[run] = run_once(run, root, args, cluster, schedule)
        results = {run: analyse(run, root, args, outcomes[run], args.figures) for run in RUNS}
        print_results(results, args, schedule, state_mib(model_width(args.state_mb)))
    except BaseException:
        args.keep = True  # the logs say what went wrong
        raise
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif root.exists():
            print(f"temp dir kept: {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
