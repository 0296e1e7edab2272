"""The mainline's checkpointer: the checkpoint loop (:mod:`~ray_resilient.checkpoint.loop`) on every
rank of a Ray Train worker group, registering each durable checkpoint through Ray's report barrier
(:mod:`~ray_resilient.checkpoint.registration`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Mapping

import ray.train
import torch
from torch.distributed.checkpoint.stateful import Stateful

from ray_resilient.checkpoint.config import CheckpointConfig
from ray_resilient.checkpoint.loop import CheckpointLoop, CheckpointStatus
from ray_resilient.checkpoint.registration import RayReportRegistrar
from ray_resilient.checkpoint.state import TrainingComponents, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import SaveResult
from ray_resilient.lifecycle import LifecycleHook
from ray_resilient.spare_workers import SpareWorkerRequest, spares_enabled
from ray_resilient.watchdog.hook import HangWatchdogHook


class Checkpointer:
    """Sharded asynchronous DCP checkpoints of a Ray Train run, with automatic resume.

    Use inside a ``TorchTrainer`` train function, after ``prepare_model``::

        with Checkpointer(model, optimizer, lr_scheduler=scheduler, data=sampler,
                          config=CheckpointConfig(interval_steps=100, seed=seed)) as ckpt:
            state = ckpt.restore()                 # newest complete checkpoint, or fresh
            for epoch in range(state.epoch, epochs):
                for batch in loader:
                    loss = train_step(batch)
                    ckpt.step_completed(epoch, {"loss": loss.item()})
            ckpt.finish()                          # final checkpoint, waited for and reported

    Args:
        model: the (DDP/FSDP-wrapped or plain) model; saved without wrapper prefixes.
        optimizer: its optimizer, saved by parameter name (so it reshards).
        lr_scheduler: saved and restored when given.
        grad_scaler: a ``torch.amp.GradScaler``; saved when given and enabled.
        data: the per-rank data position (a Stateful; a ``ReshardableStateful`` to continue
            exactly after a change of world size). If it is a
            :class:`~ray_resilient.lifecycle.DataWaitSource` (a ``VolumeDataLoader``), the
            ledger counts its wait for data apart from productive time.
        extras: further Statefuls, identical on every rank, saved once by name.
        config: when and how to checkpoint, and the hang watchdog (:class:`CheckpointConfig`).
        hooks: features called at the points of each attempt
            (:class:`~ray_resilient.lifecycle.LifecycleHook`); the hang watchdog (unless
            ``config.hang_watchdog`` is None) and spare workers (when the run's configuration turned
            them on, :mod:`ray_resilient.spare_workers`) are added.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 lr_scheduler: Any | None = None, grad_scaler: Any | None = None, data: Stateful | None = None,
                 extras: Mapping[str, Stateful] | None = None, config: CheckpointConfig = CheckpointConfig(),
                 hooks: Sequence[LifecycleHook] = ()):
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        components = TrainingComponents(model, optimizer, lr_scheduler, grad_scaler, data, extras)
        context = ray.train.get_context()
        storage = config.storage or CheckpointStorage.from_ray_context()
        watchdog = [HangWatchdogHook(config.hang_watchdog)] if config.hang_watchdog else []
        spares = [SpareWorkerRequest()] if spares_enabled() else []
        self._loop = CheckpointLoop(components, config.replace(storage=storage), rank=context.get_world_rank(),
                                    world_size=context.get_world_size(),
                                    registrar=RayReportRegistrar(storage),
                                    hooks=[*watchdog, *spares, *hooks])

    @property
    def status(self) -> CheckpointStatus:
        """Where this rank's checkpointing stands: attempt, restarts, saves committed, failed and
        deferred, the last save (a snapshot)."""
        return self._loop.status

    @property
    def train_state(self) -> TrainState:
        """Where training is (steps completed, epoch), as :meth:`restore` returned it and each step moves it."""
        return self._loop.train_state

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, *traceback: Any) -> None:
        # Failing: registering would be a barrier the other ranks never reach; the worker group is
        # about to restart from the newest complete checkpoint anyway.
        self._loop.close(exc)

    def restore(self) -> TrainState:
        """Restore the newest complete checkpoint of the run (or start fresh) and say where.

        Complete checkpoints Ray never registered count too; partial ones are skipped (and
        deleted once older than a complete one); one that cannot be read is skipped with a
        warning in favour of the previous complete one. Raises ``IncompatibleCheckpointError``
        when the newest readable checkpoint does not fit the job, and ``NoLoadableCheckpointError``
        when none can be read (see :mod:`ray_resilient.checkpoint.restore`): the run never starts
        fresh over complete checkpoints. Before anything, rank 0 takes the run directory's lease
        (:mod:`ray_resilient.checkpoint.lease`); ``RunLeaseHeldError`` when another driver's run holds it.
        """
        return self._loop.restore()

    def step_completed(self, epoch: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Count one finished training step; checkpoint when the interval or a preemption says so."""
        self._loop.step_finished(epoch, metrics)

    def progress(self, phase: str) -> None:
        """Tell the hang watchdog this rank is busy with ``phase`` and getting on: call it now and
        then during anything long between two ``step_completed`` that runs neither the model nor
        the checkpointed data loader, whose progress counts by itself (waiting for an evaluation
        loader's first batch, writing a report), so that it is not taken for a hang. Costs an
        assignment."""
        self._loop.progress(phase)

    def finish(self, metrics: Mapping[str, Any] | None = None) -> SaveResult | None:
        """Save the final state (unless just saved), wait until durable, register it with Ray.

        The checkpoint is reported with ``metrics`` (default: the last step's) and the run's
        goodput. A failed final save is made again from memory; ``CheckpointSaveError`` after
        ``max_failed_saves_in_a_row`` of them.
        """
        return self._loop.finish(metrics)

    def close(self) -> None:
        """Wait for the saves in flight (registering them), then release the writer's resources."""
        self._loop.close()
