"""The checkpoint loop both modes drive: the mainline's :class:`~ray_resilient.Checkpointer` on every
rank, survivor mode's lead as a one-rank job.

Opening and restoring: rank 0 takes the run's lease (its next generation is the attempt number of
the saves that follow) and lists the complete checkpoints; every rank loads the newest that reads,
or starts fresh; the save policy, the goodput ledger and the lifecycle hooks are told. After each
step: the lease checked, the step recorded (its data wait apart), the finished saves collected and
registered, a due or deferred save staged, a preemption answered by a save waited for. At the end
the final save (made again from memory while it fails, until too many failed in a row), and
closing. What differs by mode is injected: how a durable checkpoint is registered with Ray (a
:class:`Registrar`) and the process group (none for a one-rank loop).

A checkpoint goes state -> stage -> write/upload -> commit (``.metadata``) -> registered. A save is
registered once every rank finished it, at the next point where every rank already stops for it
(the next save, a preemption save, the end); a crash between durable and registered loses nothing:
the restore finds complete checkpoints Ray never registered, and the registrar hands them over.
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
from typing import Any, Iterator, Mapping, Protocol

import ray
import ray.train
import torch.distributed as dist

from ray_resilient.checkpoint.collectives import all_gathered, broadcast_from_rank0, smallest_on_any_rank
from ray_resilient.checkpoint.config import CheckpointConfig
from ray_resilient.checkpoint.goodput_recorder import GoodputRecorder
from ray_resilient.checkpoint.layout import CheckpointDir, checkpoint_dir_name
from ray_resilient.checkpoint.lease import RunLeaseHeldError
from ray_resilient.checkpoint.restore import RestorePlan, load_newest_loadable
from ray_resilient.checkpoint.save_policy import SavePolicy
from ray_resilient.checkpoint.session import CheckpointSession
from ray_resilient.checkpoint.state import TrainingComponents, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import SaveResult
from ray_resilient.faults import FaultInjector
from ray_resilient.goodput.events import EventKind
from ray_resilient.goodput.live_log import LiveGoodputLog
from ray_resilient.lifecycle import STARTUP, Attempt, DataWaitSource, Lifecycle, LifecycleHook
from ray_resilient.tracking import resolve_metrics_logger

logger = logging.getLogger(__name__)

RECENT_SAVES = 100  # finished saves kept in the status
SAVE_WAIT_SLACK_S = 60.0  # beyond save_timeout_s, for the lifecycle's hold: failing the save, registering it


class Registrar(Protocol):
    """How a mode registers durable checkpoints with Ray (every rank of the loop calls it at the same point)."""

    def opened(self, plan: RestorePlan, resumed: tuple[CheckpointDir, TrainState] | None) -> int | None:
        """The loop took the run's lease and found ``plan``'s complete checkpoints; it resumes from
        ``resumed`` (None: it starts fresh, or goes on from the state in memory). Returns the step of
        a checkpoint registered with Ray now, if any."""

    def durable(self, result: SaveResult, metrics: Mapping[str, Any]) -> bool:
        """Every rank made ``result``'s checkpoint durable; ``metrics`` go with it. Returns whether
        it was registered with Ray now (or only queued)."""

    def final(self, metrics: Mapping[str, Any]) -> None:
        """The run ended with its last step's checkpoint already registered: ``metrics`` alone."""


@dataclasses.dataclass(frozen=True)
class CheckpointStatus:
    """Where this rank's checkpointing stands (a snapshot: :attr:`CheckpointLoop.status`).

    ``attempt``: this attempt's number (None before the restore); ``restarts``: the run's restarts
    so far (known on rank 0); ``committed``, ``failed``: saves of this attempt every rank made
    durable, and failed; ``deferred``: due saves that waited for a staging set; ``saves_started``:
    saves staged; ``preemption_saves``: just-in-time saves for a preemption; ``last_stall_seconds``:
    how long the last save stopped the loop; ``last_save``: the newest durable save; ``recent_saves``:
    the last finished saves, durable or not.
    """

    step: int
    epoch: int
    interval_steps: int
    attempt: int | None
    restarts: int
    committed: int
    failed: int
    deferred: int
    saves_started: int
    preemption_saves: int
    last_stall_seconds: float
    last_save: SaveResult | None
    recent_saves: tuple[SaveResult, ...]


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A save started and not yet collected: what is registered with it, and its stall."""

    metrics: dict[str, Any]
    stall_seconds: float
    stall_phases: dict[str, float]


class CheckpointLoop:
    """The checkpoints of one attempt on this rank (see the module docstring).

    Args:
        components: what a checkpoint captures.
        config: how and when it checkpoints.
        rank, world_size: this rank's place (survivor mode's lead: 0 of 1).
        registrar: how durable checkpoints reach Ray.
        hooks: the lifecycle's features (the hang watchdog, spare workers).
        faults: the fault injector (default: ``config.faults``' for this rank); with ``step_faults``
            the loop fires its ``step`` faults as each step finishes, before its save (survivor mode
            fires them itself, on every replica).
        recorded_world_size: the attempt's size in the goodput ledger (survivor mode: its replicas).
    """

    def __init__(self, components: TrainingComponents, config: CheckpointConfig, *, rank: int, world_size: int,
                 registrar: Registrar, hooks: Sequence[LifecycleHook] = (), faults: FaultInjector | None = None,
                 step_faults: bool = True, recorded_world_size: int | None = None):
        self._components = components
        self.rank, self.world_size = rank, world_size
        self._registrar = registrar
        self._policy = SavePolicy(config.interval_steps, mtbf_s=config.mtbf_s,
                                 preemption_check_steps=config.preemption_check_steps, asks_alone=world_size == 1)
        data = components.data
        self._data_wait = data if isinstance(data, DataWaitSource) else None  # checked once, not every step
        self._storage = config.storage or CheckpointStorage.from_ray_context()
        self._faults = faults or FaultInjector.from_plan(config.faults, rank, self._storage.filesystem,
                                                        self._storage.experiment_path)
        self._step_faults = step_faults
        self._recorded_world_size = recorded_world_size or world_size
        self.train_state = TrainState(world_size=world_size, seed=config.seed)
        self._goodput = GoodputRecorder(self._storage, rank)
        self._session = CheckpointSession(self._storage, rank, self._faults, staging_buffers=config.staging_buffers,
                                          write_threads=config.write_threads,
                                          max_failed_saves_in_a_row=config.max_failed_saves_in_a_row,
                                          save_timeout_s=config.save_timeout_s, lease_ttl_s=config.lease_ttl_s,
                                          on_durable=self._goodput.durable)
        # The training thread's own collectives (which saves finished, the auto interval, the hooks'
        # start): the writer's group is busy on its thread, and the training group may be NCCL.
        multi_rank = world_size > 1 and dist.is_available() and dist.is_initialized()
        self._control = dist.new_group(backend="gloo") if multi_rank else None
        live_log = resolve_metrics_logger(config.goodput_logger, prefix="goodput/", name="goodput",
                                          enabled=rank == 0)
        if live_log is not None:
            hooks = [*hooks, LiveGoodputLog(self._goodput.metrics, live_log, config.goodput_log_every)]
        self._lifecycle = Lifecycle(hooks)
        self._mark = time.time()  # the end of the loop's last recorded span (restore, step or save)
        self._writing_at_mark = False  # a save's write was running then
        self._fetch_seen = 0.0  # the data loader's fetch_seconds already attributed to steps
        self._attempt: int | None = None  # this attempt's number, known once the lease is taken
        self._in_flight: deque[_InFlight] = deque()
        self._last_metrics: dict[str, Any] = {}  # the last step's, registered with the final checkpoint
        self._last_saved_step: int | None = None  # staged (and not failed) or restored
        self._durable_step = -1  # the newest durable checkpoint's step (this loop's, or found at the restore)
        self._phases: dict[str, float] = {}  # the current save's stall, by phase
        self._committed = self._saves_started = self._preemption_saves = 0
        self._last_stall_seconds = 0.0
        self._last_save: SaveResult | None = None
        self._recent_saves: deque[SaveResult] = deque(maxlen=RECENT_SAVES)
        self._start_hooks()

    def _start_hooks(self) -> None:
        identity = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                    "node_id": ray.get_runtime_context().get_node_id(), "token": uuid.uuid4().hex}
        identities = tuple(all_gathered(self._control, identity))
        self._lifecycle.attempt_started(Attempt(self.rank, self.world_size, self._control, identities, self._storage,
                                                self._components.model, self._components.data))

    # --- status ------------------------------------------------------------------------------

    @property
    def status(self) -> CheckpointStatus:
        live = self._goodput.breakdown()
        return CheckpointStatus(
            step=self.train_state.step, epoch=self.train_state.epoch, interval_steps=self._policy.interval_steps,
            attempt=self._attempt, restarts=live.attempts - 1 if live is not None else 0,
            committed=self._committed, failed=self._session.failed, deferred=self._session.deferred_saves,
            saves_started=self._saves_started, preemption_saves=self._preemption_saves,
            last_stall_seconds=self._last_stall_seconds, last_save=self._last_save,
            recent_saves=tuple(self._recent_saves))

    def goodput_metrics(self) -> dict[str, float]:
        """The run's live goodput figures (rank 0, after the restore; else empty)."""
        return self._goodput.metrics()

    def event(self, kind: EventKind, **fields: Any) -> None:
        """Another event of the run's progress for the goodput ledger (rank 0's)."""
        self._goodput.event(kind, **fields)

    # --- restore -----------------------------------------------------------------------------

    def restore(self) -> TrainState:
        """Take the run's lease and restore the newest complete checkpoint (or start fresh); every
        rank calls it (see :meth:`~ray_resilient.Checkpointer.restore`)."""
        started, wall_started = time.monotonic(), time.time()
        self._goodput.attempt_started(self._recorded_world_size)
        self._lifecycle.phase("restore", STARTUP)
        self._faults.fire("restore", 0)
        plan = self._open()
        for partial in plan.partial:
            logger.warning("Skipping partial checkpoint %s (no .metadata: its save never finished)", partial.path)
        loaded = load_newest_loadable(self._storage, plan.candidates, self._components, self.rank, self.world_size,
                                      self._session.group)
        if loaded is None and plan.partial:
            logger.warning("No complete checkpoint in %s: starting fresh", self._storage.experiment_path)
        if loaded is not None:
            ckpt, saved = loaded
            self.train_state = TrainState(saved.step, saved.epoch, self.world_size, saved.seed, saved.interval_steps)
            self._last_saved_step = self._durable_step = saved.step
        self._registered(self._registrar.opened(plan, loaded))
        self._restored(wall_started)
        if loaded is not None and self.rank == 0:
            logger.info("Resuming at step %d, epoch %d (restore took %.3fs)%s", self.train_state.step,
                        self.train_state.epoch, time.monotonic() - started, self._failures_cost())
        return self.train_state

    def take_over(self, step: int) -> None:
        """Take the run's lease and go on from the state in memory at ``step`` (survivor mode's new
        lead, whose state a lost lead wrote): no checkpoint is read."""
        self.train_state.step = step
        plan = self._open()
        if plan.candidates and plan.candidates[0].step == step:  # the lost lead made this step durable
            self._last_saved_step = self._durable_step = step
        self._registered(self._registrar.opened(plan, None))
        self._goodput.follow_run()
        self._policy.restored(step)
        self._fetch_seen, self._mark = self._data_fetch_seconds(), time.time()

    def _open(self) -> RestorePlan:
        """Rank 0 takes the lease's next generation and lists the checkpoints; every rank gets the plan."""
        registered = ray.train.get_checkpoint()
        plan: RestorePlan | RunLeaseHeldError | None = None
        if self.rank == 0:
            try:
                plan = self._session.open(registered.path if registered is not None else None)
            except RunLeaseHeldError as err:
                plan = err
        plan = broadcast_from_rank0(self._session.group, plan)
        if isinstance(plan, RunLeaseHeldError):
            raise plan
        if ray.train.get_context().get_local_rank() == 0:  # only once this run holds the directory
            self._storage.clear_local_staging()
        self._attempt = plan.attempt
        return plan

    def _registered(self, step: int | None) -> None:
        if step is not None:
            self._goodput.registered(step)

    def _failures_cost(self) -> str:
        """What the run's restarts cost so far, from its goodput ledger (rank 0, after the restore)."""
        live = self._goodput.breakdown()
        if live is None or live.attempts < 2:
            return ""
        return (f"; the run's {live.attempts - 1} restart(s) so far cost {live.steps_recomputed} steps trained again "
                f"({live.wasted:.1f}s) and {live.init_restart + live.restore:.1f}s restarting and restoring")

    def _restored(self, wall_started: float) -> None:
        self._lifecycle.phase("training")
        self._policy.restored(self.train_state.step, self.train_state.interval_steps)
        self._goodput.restored(wall_started, self.train_state.step)
        self._fetch_seen = self._data_fetch_seconds()
        self._mark = time.time()

    # --- training loop -----------------------------------------------------------------------

    def step_finished(self, epoch: int, metrics: Mapping[str, Any] | None = None,
                      started: float | None = None) -> None:
        """Count one finished step (begun at wall time ``started``; default: the end of the loop's
        last span); checkpoint when the interval or a preemption says so."""
        if self._attempt is None:
            raise RuntimeError("call Checkpointer.restore() before the first step: it takes the run's lease and numbers "
                               "this attempt's checkpoints, so that no earlier checkpoint is overwritten")
        self._session.check_lease()
        ended = time.time()
        state = self.train_state
        state.step += 1
        state.epoch = epoch
        fetched = self._data_fetch_seconds()
        self._last_metrics = dict(metrics or {})
        began = self._mark if started is None else started
        self._goodput.step(state.step, began, ended, fetched - self._fetch_seen)
        self._policy.step_finished(ended - began, beside_write=self._writing_at_mark or self._writing())
        self._lifecycle.step_finished(state.step)
        self._fetch_seen, self._mark = fetched, ended
        if self._step_faults:
            self._faults.fire("step", state.step)
        if self.world_size == 1 and self._session.in_flight:  # one rank: nothing to agree on, register at once
            self._collect_saves(wait=False)
        if self._session.deferred or self._policy.due(state.step):
            self._lifecycle.saving("save", self._last_stall_seconds if self._saves_started else None)
            self._checkpoint(self._last_metrics)
            if not self._session.deferred:
                durable = self._last_save.durable_seconds if self._last_save is not None else 0.0
                self._policy.saved(state.step, self._last_stall_seconds, durable, self._control)
            self._lifecycle.phase("training")
        elif self._faults.take_preemption_notice() or self._policy.preemption_imminent(state.step):
            self._lifecycle.saving("preemption save", self._last_stall_seconds if self._saves_started else None)
            self._preemption_saves += 1
            self._checkpoint(self._last_metrics, wait=True)
            self._lifecycle.phase("training")
        self._mark, self._writing_at_mark = time.time(), self._writing()

    def progress(self, phase: str) -> None:
        """Tell the lifecycle's hooks this rank is busy with ``phase`` and getting on."""
        self._lifecycle.phase(phase)

    def finish(self, metrics: Mapping[str, Any] | None = None) -> SaveResult | None:
        """Make the last step durable (unless it is) and register it with ``metrics`` (default: the
        last step's) and the run's goodput. A failed final save is made again from memory; after
        ``max_failed_saves_in_a_row``, ``CheckpointSaveError``."""
        metrics = dict(self._last_metrics if metrics is None else metrics)
        self._lifecycle.phase("final save", STARTUP)
        step = self.train_state.step
        result = None
        if self._last_saved_step == step and not self._session.in_flight:  # already durable and registered
            self._registrar.final({**metrics, **self._goodput.metrics(), "step": step,
                                   "epoch": self.train_state.epoch})
        else:
            if self._last_saved_step == step:
                self._in_flight[-1].metrics.update({**metrics, **self._goodput.metrics()})
                results = self._collect_saves(wait=True)
                result = results[-1] if results else None
            while self._durable_step != step:  # every staging set is free: the saves in flight were collected
                result = self._checkpoint({**metrics, **self._goodput.metrics()}, wait=True)
        self._goodput.finished(step)
        return result

    def close(self, error: BaseException | None = None) -> None:
        """End the attempt on this rank. Without ``error``: wait for the saves in flight (registering
        them), release the lease. With one: record it; the saves in flight are abandoned (they stay
        partial) and the lease left to the restart."""
        if error is None:
            self._lifecycle.phase("closing", STARTUP)
            try:
                self._collect_saves(wait=True)
            except BaseException as err:  # a hung write: abandoned, the lease left to the restart
                self._end(err)
                raise
        self._end(error)

    def _end(self, error: BaseException | None) -> None:
        if error is not None:
            self._goodput.failure(error)
        try:
            self._lifecycle.attempt_ended(failed=error is not None)
        finally:
            self._session.close(error)
            if self._control is not None and error is None:
                dist.destroy_process_group(self._control)
                self._control = None
            self._goodput.close()

    # --- internals ---------------------------------------------------------------------------

    def _writing(self) -> bool:
        """Whether a save's write is running on this rank."""
        return self._session.in_flight > self._session.finished()

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
        self.train_state.interval_steps = self._policy.interval_steps
        with self._phase("build state dict"):
            state = self._components.state_to_save(self.train_state, self.rank)
        with self._phase("staging copy"):
            self._session.save(state, step, checkpoint_dir_name(step, self._attempt), self._lifecycle.tick)
        self._saves_started += 1
        self._last_saved_step = step
        self._last_stall_seconds = time.monotonic() - started
        self._in_flight.append(_InFlight({**metrics, "step": step, "epoch": self.train_state.epoch,
                                          "checkpoint_stall_seconds": self._last_stall_seconds},
                                         self._last_stall_seconds, dict(self._phases)))
        results = self._collect_saves(wait=True) if wait else []
        self._goodput.save(step, wall_started, time.time())
        return results[-1] if results else None

    def _collect_saves(self, wait: bool) -> list[SaveResult]:
        """Register, in order, the saves every rank has finished (``wait``: all saves in flight).

        Without ``wait`` nothing blocks: the ranks agree on how many of their oldest saves have
        finished everywhere, so that every rank registers the same ones.
        """
        if wait:
            with self._lifecycle.holding("waiting for saves to be durable",
                                         self._session.save_timeout_s + SAVE_WAIT_SLACK_S):
                results = self._session.collect_all()
        else:
            finished = smallest_on_any_rank(self._control, self._session.finished()) if self._session.in_flight else 0
            results = self._session.collect(finished)
        for index, result in enumerate(results):
            started = self._in_flight.popleft()
            result = results[index] = dataclasses.replace(result, stall_seconds=started.stall_seconds,
                                                          stall_phases=started.stall_phases)
            self._recent_saves.append(result)
            if not result.ok and self._last_saved_step == result.step:
                self._last_saved_step = None
            self._session.record(result)
            if result.ok:
                self._committed += 1
                self._last_save = result
                self._durable_step = result.step
                with self._phase("register with Ray"):
                    registered = self._registrar.durable(result, {
                        **started.metrics,
                        "checkpoint_stage_seconds": result.stage_seconds,
                        "checkpoint_durable_seconds": result.durable_seconds,
                        "checkpoint_failed_saves": self._session.failed,
                        "checkpoint_deferred_saves": self._session.deferred_saves,
                    })
                self._registered(result.step if registered else None)
        return results
