"""The checkpointer: restore at the start, save on an interval, register with Ray when durable.

A checkpoint goes state -> stage -> write/upload -> commit (``.metadata``) -> register with Ray
(:mod:`~ray_resilient.checkpoint.registration`) -> retention (Ray's ``CheckpointConfig.num_to_keep``).

A save is registered one interval late: after it finished, at the next point where every rank
already stops for it (the next save, a preemption save, ``finish()``), and only if all ranks
agreed it is complete. A crash between durable and registered loses nothing:
:meth:`Checkpointer.restore` also finds complete checkpoints that Ray never registered, and
registers the one it resumes from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Mapping

import ray.train
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ray_resilient.checkpoint.collectives import all_gathered, broadcast_from_rank0, smallest_on_any_rank
from ray_resilient.checkpoint.goodput_recorder import GoodputRecorder
from ray_resilient.checkpoint.hooks import AttemptHook, DataProgressSource, DataWaitSource
from ray_resilient.checkpoint.layout import checkpoint_dir_name
from ray_resilient.checkpoint.lease import TTL_S, RunLeaseHeldError
from ray_resilient.checkpoint.registration import register_durable
from ray_resilient.checkpoint.restore import RestorePlan, load_newest_loadable
from ray_resilient.checkpoint.save_outcomes import SaveOutcomes
from ray_resilient.checkpoint.session import CheckpointSession
from ray_resilient.checkpoint.save_policy import SavePolicy
from ray_resilient.checkpoint.state import TrainingComponents, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import SaveResult
from ray_resilient.faults import FaultInjector
from ray_resilient.spare_workers import SpareWorkerRequest, helper_runtime_env, spares_enabled
from ray_resilient.tracking import MetricsLogger
from ray_resilient.watchdog.monitor import HangWatchdog, watchdog_address
from ray_resilient.watchdog.progress import HangWatchdogConfig, ProgressReporter
from ray_resilient.watchdog.step_hooks import hold_during_compilations, tick_inside_steps

logger = logging.getLogger(__name__)

RECENT_SAVES = 100  # SaveResults kept in Checkpointer.recent_saves
SAVE_WAIT_SLACK_S = 60.0  # beyond save_timeout_s, for the hang watchdog: failing the save, registering it


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A save started and not yet collected: what is reported with it, and its stall."""

    metrics: dict[str, Any]
    stall_seconds: float
    stall_phases: dict[str, float]


class Checkpointer:
    """Sharded asynchronous DCP checkpoints of a Ray Train run, with automatic resume.

    Use inside a ``TorchTrainer`` train function, after ``prepare_model``::

        with Checkpointer(model, optimizer, lr_scheduler=scheduler, data=sampler,
                          interval_steps=100, seed=seed) as ckpt:
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
            :class:`~ray_resilient.checkpoint.hooks.DataWaitSource` (a ``VolumeDataLoader``), the
            ledger counts its wait for data apart from productive time.
        extras: further Statefuls, identical on every rank, saved once by name.
        interval_steps, mtbf_s, preemption_check_steps: when to save (a
            :class:`~ray_resilient.checkpoint.save_policy.SavePolicy`, :attr:`policy`): every
            this many steps (each save stalls the loop only for the staging copy, so short
            intervals are cheap; lost work per failure is about half an interval), or
            ``"auto"``: Daly's interval for the job's ``mtbf_s`` from the measured save stall
            and step time. Every ``preemption_check_steps`` steps Ray is asked for an
            imminent preemption, which a just-in-time save answers.
        seed: the run's seed, recorded, and used to re-derive RNG streams after a resize.
        staging_buffers: sets of reused host buffers for staging (each holds this rank's share
            of the state: pinned memory on GPU). With 2, a save starts while the previous one
            is still being written, so writes slower than the interval do not stall the loop;
            when every set is still being written, a due save is deferred (one step at a time,
            counted in ``checkpoint_deferred_saves``) instead of waiting. 1 halves the memory.
        write_threads: files each rank writes in parallel (DCP's ``thread_count``), each
            uploaded in parallel to remote storage.
        save_timeout_s: a save still writing this long after it began holds up the saves due
            after it no more: each fails (counting towards ``max_failed_saves_in_a_row``), and
            waiting for it (``finish()``) raises ``CheckpointSaveError``.
        lease_ttl_s: how long the run directory's lease (one driver per run) may go unrenewed
            before a driver started again takes it over: what a restarted driver waits after its
            predecessor died. Rank 0 renews it every sixth of this.
        max_failed_saves_in_a_row: after this many saves in a row failed, raise
            :class:`CheckpointSaveError` (the attempt fails and Ray's ``FailureConfig`` restarts
            the worker group, or ends the run with the reason) instead of training on with
            nothing durable. A failed save alone is logged, counted and retried at the next
            interval.
        storage: where checkpoints go; defaults to the Ray run's storage.
        faults: a fault-injection plan (see :mod:`ray_resilient.faults`); defaults to the
            ``RAY_RESILIENT_FAULTS`` environment variable, normally unset (no faults).
        goodput_logger: where rank 0 logs the run's live goodput every ``goodput_log_every``
            steps: ``"mlflow"`` (the MLflow run of this Ray Train run, metrics ``goodput/...``),
            a callable ``(metrics, step)``, or None. The goodput ledger itself is always kept
            (``<run dir>/goodput``, see :mod:`ray_resilient.goodput`).
        hang_watchdog: when a rank is declared hung, killed, and the worker group restarted
            (:mod:`ray_resilient.watchdog`). A rank that sends no heartbeat (stopped, its node
            lost): after 2 s of silence, more where the run's heartbeats arrive late. A rank that
            answers but makes no progress: by default after ``max(60 s, 10 x`` the p99 of its
            recent steps' longest stretch without progress``)``; 600 s for the restore, the first
            3 steps, the first save's staging and each ``torch.compile`` compilation; a later
            save's staging: 10 x the one before's, if more; waiting for a save to become durable
            (a preemption save, the final save, closing): ``save_timeout_s`` more. Progress: the
            forward and backward of the model's modules, each tensor a save stages, each file or
            chunk a restore verifies or fetches, each sample the data loader reads and each failed
            read it retries, each step and ``progress(phase)``. At a step where an earlier attempt was
            declared hung, the allowance doubles. None: only Ray's worker health check
            (``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S``).
        attempt_hooks: called at points of each attempt
            (:class:`~ray_resilient.checkpoint.hooks.AttemptHook`). Spare workers
            (:mod:`ray_resilient.spare_workers`) are requested through one when the run's
            configuration turned them on.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        lr_scheduler: Any | None = None,
        grad_scaler: Any | None = None,
        data: Stateful | None = None,
        extras: Mapping[str, Stateful] | None = None,
        interval_steps: int | Literal["auto"] = 100,
        mtbf_s: float | None = None,
        seed: int = 0,
        preemption_check_steps: int = 10,
        staging_buffers: int = 2,
        write_threads: int = 4,
        max_failed_saves_in_a_row: int = 3,
        save_timeout_s: float = 600.0,
        lease_ttl_s: float = TTL_S,
        storage: CheckpointStorage | None = None,
        faults: str | None = None,
        goodput_logger: MetricsLogger | str | None = "mlflow",
        goodput_log_every: int = 50,
        hang_watchdog: HangWatchdogConfig | None = HangWatchdogConfig(),
        attempt_hooks: Sequence[AttemptHook] = (),
    ):
        self.policy = SavePolicy(interval_steps, mtbf_s=mtbf_s, preemption_check_steps=preemption_check_steps)
        self.components = TrainingComponents(model, optimizer, lr_scheduler, grad_scaler, data, extras)
        # Checked once here, not at every step (a protocol isinstance inspects the object).
        self._data_wait = data if isinstance(data, DataWaitSource) else None
        self._hooks = [*attempt_hooks, *([SpareWorkerRequest()] if spares_enabled() else [])]
        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.storage = storage or CheckpointStorage.from_ray_context()
        self.faults = FaultInjector.from_plan(faults, self.rank, self.storage.filesystem, self.storage.experiment_path)
        self.train_state = TrainState(world_size=self.world_size, seed=seed)
        self.goodput = GoodputRecorder(self.storage, self.rank, log_every=goodput_log_every,
                                       metrics_logger=goodput_logger)
        self.goodput.attempt_started(self.world_size)
        # Rank 0 holds the run directory's lease (one writer per run) from restore() to close().
        self._session = CheckpointSession(self.storage, self.rank, self.faults, staging_buffers=staging_buffers,
                                          write_threads=write_threads,
                                          max_failed_saves_in_a_row=max_failed_saves_in_a_row,
                                          save_timeout_s=save_timeout_s, lease_ttl_s=lease_ttl_s,
                                          on_durable=self.goodput.durable)
        self._writer = self._session.writer
        self.outcomes = self._session.outcomes
        # The training thread's own collectives (which saves finished, the auto interval): the
        # writer's group is busy on its thread, and the training group may be NCCL.
        self._control = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self._watchdog, self._progress = self._start_watchdog(hang_watchdog) if hang_watchdog else (None, None)
        self._tick_hooks = tick_inside_steps(model, self._progress.tick) if self._progress else []
        self._stop_compile_holds = hold_during_compilations(self._progress) if self._progress else None
        self._mark = time.time()  # the end of the loop's last recorded span (restore, step or save)
        self._fetch_seen = 0.0  # the data loader's fetch_seconds already attributed to steps
        self._attempt: int | None = None  # this attempt's number, known once restore() ran
        self._in_flight: deque[_InFlight] = deque()
        self._last_metrics: dict[str, Any] = {}  # the last step's, reported with the final checkpoint
        self._last_saved_step: int | None = None
        self._first_step_done = False
        self._phases: dict[str, float] = {}  # the current save's stall, by phase
        self.checkpoints_committed = 0  # saves of this attempt every rank made durable
        self.saves_started = 0  # saves of this attempt staged (the loop stalled for each)
        self.last_stall_seconds = 0.0  # how long the loop stopped for the last save
        self.last_save: SaveResult | None = None  # the newest save every rank made durable
        self.recent_saves: deque[SaveResult] = deque(maxlen=RECENT_SAVES)  # finished saves, durable or not

    @property
    def deferred_saves(self) -> int:
        """Due saves that waited for a staging buffer set (writes slower than the interval)."""
        return self._session.deferred_saves

    def __enter__(self) -> "Checkpointer":
        return self

    def _start_watchdog(self, config: HangWatchdogConfig) -> tuple[Any, ProgressReporter]:
        """Rank 0 starts this attempt's watchdog actor (it owns it) with every rank's identity;
        every rank reports to it (its reporter's thread connects while the training thread goes on)."""
        identity = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                    "node_id": ray.get_runtime_context().get_node_id()}
        identities = all_gathered(self._writer.group, identity)
        watchdog, name = None, None
        if self.rank == 0:
            name = f"ray_resilient_watchdog_{uuid.uuid4().hex}"
            watchdog = HangWatchdog.options(name=name, runtime_env=helper_runtime_env()).remote(
                self.storage, identities, silent_floor_s=config.silent_floor_s)
        name = broadcast_from_rank0(self._writer.group, name)
        data = self.components.data
        sources = [lambda: data.loading_progress] if isinstance(data, DataProgressSource) else []
        return watchdog, ProgressReporter(config, lambda: watchdog_address(name), identity, sources)

    def _note(self, phase: str, allowance_s: float | None = None) -> None:
        """Tell the hang watchdog the training thread began ``phase`` (see :class:`ProgressReporter`)."""
        if self._progress is not None:
            self._progress.phase(phase, allowance_s)

    def _note_startup(self, phase: str) -> None:
        """:meth:`_note` of a phase allowed the startup allowance."""
        if self._progress is not None:
            self._note(phase, self._progress.config.startup_allowance_s)

    @contextmanager
    def _waiting_for_saves(self) -> Iterator[None]:
        """Tell the hang watchdog the training thread waits for the saves in flight, which
        ``save_timeout_s`` bounds, for the ``with`` block."""
        if self._progress is None:
            yield
            return
        with self._progress.allowing("waiting for saves to be durable",
                                     self._session.save_timeout_s + SAVE_WAIT_SLACK_S):
            yield

    def _note_save(self, phase: str) -> None:
        """Tell the hang watchdog the training thread began staging a save (``phase``)."""
        if self._progress is not None:
            self._progress.saving(phase, self.last_stall_seconds if self.saves_started else None)

    def _stop_watchdog(self, failed: bool = False) -> None:
        for hook in self._tick_hooks:
            hook.remove()
        self._tick_hooks = []
        if self._stop_compile_holds is not None:
            self._stop_compile_holds()
            self._stop_compile_holds = None
        if self._progress is not None:
            self._progress.close(failed)
            self._progress = None
        if self._watchdog is not None:
            ray.kill(self._watchdog)
            self._watchdog = None

    def __exit__(self, exc_type: Any, exc: BaseException | None, *traceback: Any) -> None:
        if exc is None:
            self.close()
        else:
            # Failing: registering would be a barrier the other ranks never reach; the
            # worker group is about to restart from the newest complete checkpoint anyway.
            self.goodput.failure(exc)
            self._stop_watchdog(failed=True)
            self._session.close(exc)
            self.goodput.close()

    # --- restore ---------------------------------------------------------------------------

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
        started, wall_started = time.monotonic(), time.time()
        self._note_startup("restore")
        self.faults.fire("restore", 0)
        group = self._writer.group
        registered = ray.train.get_checkpoint()
        registered_path = registered.path if registered is not None else None
        plan: RestorePlan | RunLeaseHeldError | None = None
        if self.rank == 0:
            try:
                plan = self._session.open(registered_path)
            except RunLeaseHeldError as err:
                plan = err
        plan = broadcast_from_rank0(group, plan)
        if isinstance(plan, RunLeaseHeldError):
            raise plan
        if ray.train.get_context().get_local_rank() == 0:  # only once this run holds the directory
            self.storage.clear_local_staging()
        self._attempt = plan.attempt
        for partial in plan.partial:
            logger.warning("Skipping partial checkpoint %s (no .metadata: its save never finished)", partial.path)
        loaded = load_newest_loadable(
            self.storage, plan.candidates, self.components, self.rank, self.world_size, group
        )
        if loaded is None:
            if plan.partial:
                logger.warning("No complete checkpoint in %s: starting fresh", self.storage.experiment_path)
            self._restored(wall_started)
            return self.train_state
        ckpt, saved = loaded
        self.train_state = TrainState(saved.step, saved.epoch, self.world_size, saved.seed, saved.interval_steps)
        self._last_saved_step = saved.step
        older = {c.path for c in plan.candidates if c < ckpt}
        if registered_path is None or registered_path in older:
            # Durable before a crash but never registered: hand it to Ray now, so that
            # get_checkpoint(), Result.checkpoint and num_to_keep all know it.
            self._register(ckpt.path, {"step": saved.step, "epoch": saved.epoch})
        took = time.monotonic() - started
        self._restored(wall_started)
        if self.rank == 0:
            logger.info("Resuming at step %d, epoch %d (restore took %.3fs)%s", saved.step, saved.epoch, took,
                        self._failures_cost())
        return self.train_state

    def _failures_cost(self) -> str:
        """What the run's restarts cost so far, from its goodput ledger (rank 0, after the restore)."""
        live = self.goodput.breakdown()
        if live is None or live.attempts < 2:
            return ""
        return (f"; the run's {live.attempts - 1} restart(s) so far cost {live.steps_recomputed} steps trained again "
                f"({live.wasted:.1f}s) and {live.init_restart + live.restore:.1f}s restarting and restoring")

    def _restored(self, wall_started: float) -> None:
        self._note("training")
        self.policy.restored(self.train_state.step, self.train_state.interval_steps)
        self.goodput.restored(wall_started, self.train_state.step)
        self._fetch_seen = self._data_fetch_seconds()
        self._mark = time.time()

    # --- training loop -----------------------------------------------------------------------

    def step_completed(self, epoch: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Count one finished training step; checkpoint when the interval or a preemption says so."""
        if self._attempt is None:
            raise RuntimeError("call Checkpointer.restore() before the first step: it takes the run's lease "
                               "and numbers this attempt's checkpoints, so that no earlier checkpoint is overwritten")
        self._session.lease.check()
        ended = time.time()
        state = self.train_state
        state.step += 1
        state.epoch = epoch
        fetched = self._data_fetch_seconds()
        self._last_metrics = dict(metrics or {})
        self.goodput.step(state.step, self._mark, ended, fetched - self._fetch_seen)
        self.policy.step_finished(ended - self._mark)
        if self._progress is not None:
            self._progress.step(state.step)
        self._fetch_seen, self._mark = fetched, ended
        self.faults.fire("step", state.step)
        if not self._first_step_done:
            self._first_step_done = True
            for hook in self._hooks:
                hook.first_step()
        if self._session.deferred or self.policy.due(state.step):
            self._note_save("save")
            self._checkpoint(metrics or {})
            if not self._session.deferred:
                durable = self.last_save.durable_seconds if self.last_save is not None else 0.0
                self.policy.saved(state.step, self.last_stall_seconds, durable, self._control)
            self._note("training")
        elif self.faults.take_preemption_notice() or self.policy.preemption_imminent(state.step):
            self._note_save("preemption save")
            self._checkpoint(metrics or {}, wait=True)
            self._note("training")
        self._mark = time.time()

    def progress(self, phase: str) -> None:
        """Tell the hang watchdog this rank is busy with ``phase`` and getting on: call it now and
        then during anything long between two ``step_completed`` that runs neither the model nor
        the checkpointed data loader, whose progress counts by itself (waiting for an evaluation
        loader's first batch, writing a report), so that it is not taken for a hang. Costs an
        assignment."""
        self._note(phase)

    def finish(self, metrics: Mapping[str, Any] | None = None) -> SaveResult | None:
        """Save the final state (unless just saved), wait until durable, register it with Ray.

        The checkpoint is reported with ``metrics`` (default: the last step's) and the run's
        goodput. Raises CheckpointSaveError if the final checkpoint could not be made durable.
        """
        metrics = self._last_metrics if metrics is None else metrics
        self._note_startup("final save")
        if self._last_saved_step == self.train_state.step and not self._writer.in_flight:
            # The last step's checkpoint is already registered: report the final metrics alone.
            ray.train.report({**metrics, **self.goodput.metrics(), "step": self.train_state.step,
                              "epoch": self.train_state.epoch})
            self.goodput.finished(self.train_state.step)
            return None
        if self._last_saved_step == self.train_state.step:
            self._in_flight[-1].metrics.update({**metrics, **self.goodput.metrics()})
            results = self._collect_saves(wait=True)
            result = results[-1] if results else None
        else:
            result = self._checkpoint({**metrics, **self.goodput.metrics()}, wait=True)
        SaveOutcomes.final(result, self.train_state.step)
        self.goodput.finished(self.train_state.step)
        return result

    def close(self) -> None:
        """Wait for the saves in flight (registering them), then release the writer's resources."""
        self._note_startup("closing")
        try:
            self._collect_saves(wait=True)
        except BaseException as err:  # a hung write: abandoned, the lease left to the restart
            self._stop_watchdog(failed=True)
            self._session.close(err)
            raise
        self._stop_watchdog()
        self._session.close()
        if self._control is not None:
            dist.destroy_process_group(self._control)
            self._control = None
        self.goodput.close()

    # --- internals ---------------------------------------------------------------------------

    def _data_fetch_seconds(self) -> float:
        return self._data_wait.fetch_seconds if self._data_wait is not None else 0.0

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Time a part of the current save's stall (reported in its ``SaveResult.stall_phases``)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.monotonic() - started

    def _checkpoint(self, metrics: Mapping[str, Any], wait: bool = False) -> SaveResult | None:
        """Start a save of the current state, or defer it while every staging buffer set is busy.

        ``wait``: wait for the saves in flight, then for this one (final and preemption saves).
        """
        started, wall_started = time.monotonic(), time.time()
        self._phases = {}
        with self._phase("collect finished saves"):
            self._collect_saves(wait=wait)
        step = self.train_state.step
        if not self._session.may_save(step):
            return None
        self.train_state.interval_steps = self.policy.interval_steps
        with self._phase("build state dict"):
            state = self.components.state_to_save(self.train_state, self.rank)
        with self._phase("staging copy"):
            self._writer.save(state, step, checkpoint_dir_name(step, self._attempt),
                              self._progress.tick if self._progress is not None else None)
        self.saves_started += 1
        self._last_saved_step = step
        self.last_stall_seconds = time.monotonic() - started
        self._in_flight.append(_InFlight({**metrics, "step": step, "epoch": self.train_state.epoch,
                                          "checkpoint_stall_seconds": self.last_stall_seconds},
                                         self.last_stall_seconds, dict(self._phases)))
        results = self._collect_saves(wait=True) if wait else []
        self.goodput.save(step, wall_started, time.time())
        return results[-1] if results else None

    def _collect_saves(self, wait: bool) -> list[SaveResult]:
        """Register, in order, the saves every rank has finished (``wait``: all saves in flight).

        Without ``wait`` nothing blocks: the ranks agree on how many of their oldest saves have
        finished everywhere, so that every rank registers the same ones (each registration is
        a barrier in Ray).
        """
        if wait:
            with self._waiting_for_saves():
                results = self._session.collect_all()
        else:
            finished = smallest_on_any_rank(self._control, self._writer.finished()) if self._writer.in_flight else 0
            results = self._writer.collect(finished)
        for index, result in enumerate(results):
            started = self._in_flight.popleft()
            result = results[index] = dataclasses.replace(result, stall_seconds=started.stall_seconds,
                                                          stall_phases=started.stall_phases)
            self.recent_saves.append(result)
            if not result.ok and self._last_saved_step == result.step:
                self._last_saved_step = None
            self.outcomes.record(result)
            if result.ok:
                self.checkpoints_committed += 1
                self.last_save = result
                self._register(result.path, {
                    **started.metrics,
                    "checkpoint_stage_seconds": result.stage_seconds,
                    "checkpoint_durable_seconds": result.durable_seconds,
                    "checkpoint_failed_saves": self.outcomes.failed,
                    "checkpoint_deferred_saves": self.deferred_saves,
                })
        return results

    def _register(self, path: str, metrics: Mapping[str, Any]) -> None:
        with self._phase("register with Ray"):
            self.goodput.registered(metrics["step"])
            register_durable(metrics, path, self.storage.filesystem)
