"""The job of the experiment kit and the loops that train it, in Ray Train's workers.

:class:`ChaosJob` describes it (an MLP on :class:`SyntheticBatches`, or a torchvision model such as
the main job's ResNet-18 on an image volume through :class:`~ray_resilient.data.VolumeDataLoader`;
emulated accelerator compute, the checkpoint interval and the kills); :class:`Worker` builds it in one worker; the train
functions run it in whole-group restart mode (:func:`train_restarting`) or survivor mode
(:func:`train_survivors`, whose loop :func:`train_replica` the tests run too). A benchmark's own
baseline builds on :class:`Worker`. Every loop writes the kit's records (:mod:`.records`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_resilient.testing.kit.records import Recorder, RecordKind

SYNTHETIC_DATA = "ray_resilient.testing.synthetic_data"
# Modules whose presence when a train function starts says what its worker process imported before.
PRELOAD_PROBES = ("torch", "torch.distributed.checkpoint", SYNTHETIC_DATA)
OPTIMIZERS = ("sgd", "adam")
NOISE = 0.01  # dropout-like input noise of the survivor loop (see train_replica)


@dataclass(frozen=True)
class ChaosJob:
    """The job an experiment trains; it travels as the train function's config (``asdict``).

    ``model`` "mlp": an MLP (``FEATURES`` -> ``square_layers`` square ``Linear`` layers of ``width``
    -> ``CLASSES``); or a torchvision classification model by name (the main job's "resnet18", with
    BatchNorm), for ``CLASSES`` classes. Its data: :class:`SyntheticBatches` (``samples`` an epoch,
    ``global_batch``, the order from ``seed``); or with ``volume`` (a directory or URI in ImageFolder
    layout of ``samples`` images of ``CLASSES`` classes, :func:`make_image_volume`'s) the volume
    dataset the main job reads, its images at ``image_size`` pixels, ``loader_workers`` DataLoader
    workers a rank. It trains ``max_steps`` steps. A step is ``step_seconds`` of ``time.sleep`` standing in for the
    accelerator's compute (per micro-batch in survivor mode), then a real forward/backward/optimizer
    step: ``optimizer`` "sgd" (momentum 0.9, lr 0.01) or "adam" (lr 1e-5).
    """

    seed: int
    samples: int
    global_batch: int
    max_steps: int
    step_seconds: float
    width: int = 512
    square_layers: int = 2
    model: str = "mlp"
    volume: str = ""
    image_size: int = 32
    loader_workers: int = 1
    optimizer: str = "sgd"
    interval: int | str = 20  # steps between checkpoints; "auto": the planner's, from mtbf_s
    mtbf_s: float | None = None
    faults: str = ""  # kills in steps (ray_resilient.faults), fired by the Checkpointer or the replicas
    kill_schedule: Sequence[Sequence[float]] = ()  # timed kills (see TimedKills)
    record_dir: str = ""  # set by fit_on
    t0: float = 0.0  # set by fit_in_driver: when fit() was called, the timed kills' clock

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")


def mlp(width: int, square_layers: int, features: int | None = None) -> Any:
    """An MLP: ``features`` (default FEATURES; its input flattened) -> ``square_layers`` square layers
    of ``width`` -> CLASSES, with ReLUs."""
    import torch

    from ray_resilient.testing.synthetic_data import CLASSES, FEATURES

    layers: list[torch.nn.Module] = [torch.nn.Flatten(), torch.nn.Linear(features or FEATURES, width), torch.nn.ReLU()]
    for _ in range(square_layers):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, CLASSES))


def job_model(job: ChaosJob) -> Any:
    """The job's model, its weights drawn from torch's global RNG."""
    if job.model == "mlp":
        return mlp(job.width, job.square_layers, 3 * job.image_size ** 2 if job.volume else None)
    import torchvision

    from ray_resilient.testing.synthetic_data import CLASSES

    return torchvision.models.get_model(job.model, num_classes=CLASSES)


def volume_loader(job: ChaosJob, rank: int, world_size: int) -> Any:
    """The job's :class:`~ray_resilient.data.VolumeDataLoader` for ``rank`` of ``world_size``: the
    main job's training augmentation, no metrics logged."""
    from ray_resilient.data import Volume, VolumeDataLoader, VolumeImageDataset, default_transform

    dataset = VolumeImageDataset(Volume(job.volume), global_batch=job.global_batch, rank=rank, world_size=world_size,
                                 seed=job.seed, transform=default_transform(job.image_size))
    return VolumeDataLoader(dataset, num_workers=job.loader_workers, metrics_logger=None)


class TimedKills:
    """SIGKILLs this process at its rank's planned moments of the run's wall clock, each once per run.

    ``schedule`` holds (seconds after ``t0``, rank) pairs (:func:`timed_kill_schedule`). A kill
    fires at the end of the first step of its rank that ends after its moment (between steps, like
    a ``kill:step=N`` fault); a marker file, created atomically first, makes the restarted attempt
    go past it. Kills come in wall-clock time because failures do: a schedule in steps would hand
    a slower run fewer failures an hour.
    """

    def __init__(self, schedule: Sequence[Sequence[float]], t0: float, rank: int, marker_dir: Path,
                 record: Recorder):
        marker_dir.mkdir(parents=True, exist_ok=True)
        self.t0, self.marker_dir, self.record = t0, marker_dir, record
        self.pending = [(at, index) for index, (at, kill_rank) in enumerate(schedule)
                        if kill_rank == rank and not (marker_dir / f"kill-{index}").exists()]

    def check(self, step: int) -> None:
        if not self.pending or time.time() - self.t0 < self.pending[0][0]:
            return
        at, index = self.pending.pop(0)
        try:
            os.close(os.open(self.marker_dir / f"kill-{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        self.record(RecordKind.KILL, step=step, planned=at)
        os.kill(os.getpid(), signal.SIGKILL)


class Worker:
    """What every mode's train function shares in one Ray Train worker: its records, the job's model
    (in DDP, or with ``replica=True`` a whole replica of survivor mode, served whole global batches),
    optimizer, data and timed kills. Records START, IMPORTED and MODEL_READY as it gets there."""

    def __init__(self, config: dict[str, Any], replica: bool = False):
        entered = time.time()
        preloaded = [m for m in PRELOAD_PROBES if m in sys.modules]
        import ray.train
        import torch
        from ray.train.torch import prepare_model

        from ray_resilient.testing.synthetic_data import SyntheticBatches

        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.job = job = ChaosJob(**config)
        self.record = Recorder(job.record_dir, self.rank)
        self.record(RecordKind.START, t=entered, world_size=self.world, preloaded=preloaded)
        self.record(RecordKind.IMPORTED)
        torch.manual_seed(job.seed)
        self.module = job_model(job)
        self.model = self.module if replica else prepare_model(self.module)
        self.optimizer = (torch.optim.Adam(self.model.parameters(), lr=1e-5) if job.optimizer == "adam"
                          else torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9))
        if job.volume:  # a replica's micro-batches are assigned it step by step (survivor mode)
            self.data = volume_loader(job, self.rank, self.world)
            self.batches_per_epoch = self.data.volume_dataset.batches_per_epoch(0)
        else:
            self.data = SyntheticBatches(job.samples, job.global_batch, job.seed,
                                         *((0, 1) if replica else (self.rank, self.world)))
            self.batches_per_epoch = self.data.batches_per_epoch
        self.kills = TimedKills(job.kill_schedule, job.t0, self.rank, Path(job.record_dir) / "kills", self.record)
        self.record(RecordKind.MODEL_READY)

    def train(self, step: int, step_completed: Callable[[int, int], None]) -> int:
        """Train on from ``step`` (the data already positioned) until ``max_steps``; each step is
        recorded, handed to ``step_completed(step, epoch)``, then checked for a due timed kill.
        Returns the last step."""
        import torch

        first = True
        while step < self.job.max_steps:
            for item in self.data:
                ids, x, y = (item.sample_ids, item.images, item.labels) if self.job.volume else item
                if first:
                    self.record(RecordKind.FIRST_BATCH, step=step)
                    first = False
                time.sleep(self.job.step_seconds)  # the accelerator's compute
                loss = torch.nn.functional.cross_entropy(self.model(x), y)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                step += 1
                # Before step_completed: a step fault fires inside it, after this record.
                epoch = (step - 1) // self.batches_per_epoch  # the batch's: a VolumeDataLoader has moved on
                self.record(RecordKind.STEP, step=step, epoch=epoch, parts={self.rank: ids.tolist()})
                step_completed(step, epoch)
                self.kills.check(step)
                if step >= self.job.max_steps:
                    break
        return step

    def start_epoch(self, epoch: int) -> None:
        """Position the data at the first global batch of ``epoch``."""
        if self.job.volume:
            self.data.epoch, self.data.batch = epoch, 0
        else:
            self.data.load_state_dict({"epoch": epoch, "consumed": 0})


def train_restarting(config: dict[str, Any]) -> None:
    """Whole-group restart mode: DDP and a ``Checkpointer`` (sharded async DCP every ``interval``
    steps, the exact data position); each attempt restores the newest complete checkpoint."""
    worker = Worker(config)
    job = worker.job
    from ray_resilient.checkpoint import CheckpointConfig, Checkpointer

    checkpoints = CheckpointConfig(interval_steps=job.interval, mtbf_s=job.mtbf_s, seed=job.seed, faults=job.faults,
                                   goodput_logger=None)
    with Checkpointer(worker.model, worker.optimizer, data=worker.data, config=checkpoints) as ckpt:
        worker.record(RecordKind.RESTORE_START)
        state = ckpt.restore()
        worker.record(RecordKind.RESTORED, step=state.step)
        step = worker.train(state.step, lambda _step, epoch: ckpt.step_completed(epoch))
        ckpt.finish()
    worker.record(RecordKind.FINISHED, step=step)


def train_survivors(config: dict[str, Any]) -> None:
    """Survivor mode: each worker a whole replica, the global batch in one micro-batch per worker;
    the lead checkpoints every ``interval`` steps (the safety net for losing the whole job)."""
    from ray_resilient.checkpoint import CheckpointConfig

    worker = Worker(config, replica=True)
    job = worker.job
    train_replica(worker.model, worker.optimizer, worker.data, worker.record, max_steps=job.max_steps,
                  step_seconds=job.step_seconds, after_step=lambda step, lead: worker.kills.check(step),
                  micro_batches=worker.world, config=CheckpointConfig(interval_steps=job.interval, seed=job.seed,
                                                                      faults=job.faults, goodput_logger=None))


def train_replica(model: Any, optimizer: Any, data: Any, record: Recorder, *, max_steps: int, step_seconds: float,
                  digest: bool = False, after_step: Callable[[int, bool], None] | None = None,
                  flatten_images: bool = False,
                  **options: Any) -> bool:
    """The survivor-mode loop: ``SurvivingReplicas(model, optimizer, **options)`` trains global
    batches of ``data`` until ``max_steps``: a :class:`SyntheticBatches` of the whole batch, or a
    :class:`~ray_resilient.data.VolumeDataLoader` (its images flattened with ``flatten_images``),
    which survivor mode then gives each replica its micro-batches.

    A micro-batch is ``step_seconds`` of emulated compute, then the loss of the model on its
    samples with a little input noise: drawn from the stream survivor mode derives per
    micro-batch, so a replica that drew from any other stream shows in the weights. Records
    JOINED, each micro-batch COMPUTED (its sample ids as the data gave them), every committed STEP
    (with the state's ``sha`` when ``digest``: bitwise comparisons across replicas) and FINISHED;
    ``after_step(step, is_lead)`` runs after each. Returns whether this process ended as the lead (which
    saved the final checkpoint).
    """
    import torch

    from ray_resilient.survivors import SurvivingReplicas

    volume = hasattr(data, "assign_micro_batches")  # a VolumeDataLoader (not imported: torchvision)
    per_epoch = data.volume_dataset.batches_per_epoch(0) if volume else data.batches_per_epoch
    trained_by: list[int] = []  # the membership of the step's last attempt: the one that committed it

    def loss_of(step: int, part: int) -> torch.Tensor:
        if volume:
            batch = data.micro_batch(step, part)
            ids, x, y = batch.sample_ids, batch.images.flatten(1) if flatten_images else batch.images, batch.labels
        else:
            ids, x, y = data.micro_batch(step, part, replicas.micro_batches)
        trained_by[:] = replicas.members
        record(RecordKind.COMPUTED, step=step + 1, epoch=step // per_epoch, members=trained_by, part=part,
               ids=ids.tolist())
        time.sleep(step_seconds)  # the accelerator's compute
        return torch.nn.functional.cross_entropy(model(x + NOISE * torch.randn_like(x)), y)

    def sha() -> dict[str, str]:
        return {"sha": state_digest(model, optimizer)} if digest else {}

    with SurvivingReplicas(model, optimizer, data=data if volume else None, **options) as replicas:
        record(RecordKind.JOINED, step=replicas.step, finished=replicas.finished, **sha())
        while replicas.step < max_steps:
            loss = replicas.train_step(loss_of)
            replicas.result_metrics = {"loss": loss}
            record(RecordKind.STEP, step=replicas.step, epoch=(replicas.step - 1) // per_epoch, members=trained_by,
                   loss=loss, **sha())  # not replicas.members: a replacement may have joined at this step's end
            if after_step is not None:
                after_step(replicas.step, replicas.is_lead)
        lead = replicas.is_lead
    record(RecordKind.FINISHED, step=replicas.step)
    return lead


def state_digest(model: Any, optimizer: Any) -> str:
    """A digest of a replica's whole state: parameters, buffers and optimizer state."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for tensor in list(model.state_dict().values()) + [
            v for state in optimizer.state_dict()["state"].values() for v in state.values() if torch.is_tensor(v)]:
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()
