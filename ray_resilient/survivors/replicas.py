"""Replicas that keep training when one of them dies: the worker's side of survivor mode.

Each Ray Train worker is one full replica of the model (DDP-style). A global batch is cut into a
fixed number of micro-batches; the live replicas share them out (micro-batch ``k`` to the member
of rank ``k % members``), and each micro-batch's gradient is its own row of the step's exchange
(:mod:`.exchange`): a reduce-scatter that adds the rows in micro-batch order, then an all-gather.
So the step's gradient is the same bits whichever replicas computed it. Buffers the forward pass
changes (BatchNorm's running statistics) go the same way: each micro-batch's forward starts from
the step's buffers, and the change it made travels in its row; the exchange adds the changes in
micro-batch order and divides by their count, and every replica adds the mean to the step's
buffers (integer buffers, BatchNorm's ``num_batches_tracked``, take micro-batch 0's change). A
step updates the running statistics once, with the mean of its micro-batches' statistics: a run
that lost replicas ends with bitwise the weights of an uninterrupted run, and no sample of a kept
step is lost or trained twice. The cost: with one micro-batch per replica, each sends what DDP's
ring all-reduce sends (``2 (members - 1) / members`` gradients), ``ceil(micro_batches /
members)`` times that in the reduce-scatter with more; not overlapped with the backward pass.

With ``data`` (a :class:`~ray_resilient.data.VolumeDataLoader`), each step tells the replica's
loader which micro-batches the membership gives it, and it reads them from the volume through its
workers, cache and prefetching; the data position goes into the lead's checkpoints.

Work the lead alone does between steps (an evaluation, an export) may take as long as it takes:
the others enter a step's exchange only once the lead has begun that step (it says so in the
coordinator's store), and wait for it there, asking the coordinator whether a member was lost,
not in a gloo collective, whose ``timeout_s`` would drop the step and re-form the membership.

A step commits on a replica when its exchange succeeded there. A replica that dies breaks the
gloo connections of that exchange at once; the others drop the step, ask the
:class:`~ray_resilient.survivors.coordinator.MembershipCoordinator` for the next membership and
train the same step again among themselves, in the same processes. Ray Train starts a
replacement in the dead replica's place; it copies model, optimizer, scheduler, scaler, extras
and step from a live replica's memory over gloo (no storage read), and joins at the next step
boundary.

The lead replica runs the checkpoint loop the mainline runs, as a one-rank job (:mod:`.lead`):
the run's lease, saves at the interval and for a preemption, the goodput ledger (the lead's wait
for data apart). Its durable checkpoints are registered with Ray (:mod:`.registrations`: ``Result.checkpoint``,
``get_checkpoint()``, ``CheckpointConfig.num_to_keep``) at the next step every replica trains,
or at the run's end once a process of every replica is up (a replacement Ray started after the
last step registers them with the others). Ray drops the registrations waiting at its report
barrier when it replaces a replica: the replacement says which checkpoint Ray had as it started
(its ``get_checkpoint()``), and the lead offers those after it again. A lead lost at the end,
before the others learned that the run finished, leaves them to re-form: their new lead finishes
(the lost lead's final checkpoint counts once durable).
A worker group starts with one replica restoring the newest complete checkpoint and the others
copying from it, so every replica starts from one read; a membership left without a replica
holding state starts the same way. The others wait for that read as long as it gets on; a reader
that makes no progress for :data:`~.membership.RESTORE_STALL_TIMEOUTS` x ``timeout_s`` (a read stuck) counts
as lost, and the others re-form.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import ray
import ray.train
import torch
from torch.distributed.checkpoint.stateful import Stateful

from ray_resilient.checkpoint.config import CheckpointConfig
from ray_resilient.checkpoint.state import TrainingComponents, reseed_rng
from ray_resilient.faults import FaultInjector
from ray_resilient.goodput.events import EventKind
from ray_resilient.lifecycle import Lifecycle
from ray_resilient.spare_workers import SpareWorkerRequest, spares_enabled
from ray_resilient.storage.run import RunStorage
from ray_resilient.survivors.coordinator import FINAL_REPLACEMENT_WAIT_S, Membership
from ray_resilient.survivors.exchange import CONTROLS, MicroBatchExchange
from ray_resilient.survivors.lead import FinalSaveFailed, Lead
from ray_resilient.survivors.run_end import RunEnd
from ray_resilient.survivors.membership import RESTORE_PROGRESS_EVERY_S, FormationError, MembershipLink
from ray_resilient.survivors.registrations import Offers, Registrations
from ray_resilient.watchdog.progress import listening_to_progress

logger = logging.getLogger(__name__)

LossOf = Callable[[int, int], torch.Tensor]
MAX_REFORMS_WITHOUT_A_STEP = 10  # then the replica fails instead of re-forming again (no livelock)


class MicroBatchSource(Protocol):
    """Data that serves each replica the micro-batches the membership gives it (a
    :class:`~ray_resilient.data.VolumeDataLoader`), with a position a checkpoint holds."""

    def assign_micro_batches(self, step: int, rank: int, members: int, micro_batches: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SurvivingReplicas:
    """This worker's replica in survivor mode (a ``TorchTrainer`` with ``SurvivorConfig``).

    Use inside the train function::

        with SurvivingReplicas(model, optimizer, micro_batches=3, config=CheckpointConfig(seed=seed)) as replicas:
            while replicas.step < total_steps:
                replicas.train_step(lambda step, k: loss_fn(model(x[step][k]), y[step][k]))

    ``loss_of(step, k)`` returns the mean loss of micro-batch ``k`` of global batch ``step``
    (0-based, the step being trained). It runs with RNG streams derived from (seed, step, k), so
    its randomness does not depend on which replica runs it. With ``data``, a
    :class:`~ray_resilient.data.VolumeDataLoader`, the replica's micro-batches come from the volume
    through its workers, cache and prefetching: ``loss_of`` reads ``data.micro_batch(step, k)``::

        loader = VolumeDataLoader(VolumeImageDataset(volume, global_batch=96, rank=rank, world_size=world, seed=seed))
        with SurvivingReplicas(model, optimizer, micro_batches=3, data=loader) as replicas:
            while replicas.step < total_steps:
                replicas.train_step(lambda step, k: loss_fn(model, loader.micro_batch(step, k)))

    Args:
        model, optimizer, lr_scheduler: the replica's (not wrapped in DDP: gradients, and the
            buffers the forward pass changes, are reduced here).
        grad_scaler: a ``torch.amp.GradScaler``: each micro-batch's loss is scaled before its
            backward pass, the step unscales the exchanged gradient, skips it when it holds an inf
            or NaN (the same on every replica) and updates the scale; saved with the state.
        data: the volume's loader: each step it is given the micro-batches this replica computes
            under the current membership (:meth:`~ray_resilient.data.VolumeDataLoader.assign_micro_batches`),
            and its position goes into the lead's checkpoints; the lead's wait for it is counted apart
            in the goodput ledger.
        extras: further Statefuls, identical on every replica: copied to a replacement and saved.
        micro_batches: micro-batches per global batch: at least the replicas (ValueError), best
            a multiple of them.
        timeout_s: how long a collective waits on a connection that carries nothing while every
            replica still sends its heartbeats (a partition between two replicas); a replica that
            stops answering altogether is dropped sooner (:mod:`.liveness`). Work the lead alone
            does between steps is not bounded by it (see the module docstring); a restore from
            storage that makes no progress is, by :data:`~.membership.RESTORE_STALL_TIMEOUTS` times it.
        config: the lead's checkpoints, as the mainline's
            (:class:`~ray_resilient.checkpoint.CheckpointConfig`): the interval (a preemption
            answered by a save too), the seed (RNG streams per micro-batch are derived from it), the
            storage, the lease, escalation after failed saves (another replica takes over as the
            lead; a failed final save is made again from memory, and when it cannot be made durable
            every replica raises), live goodput. Its ``faults`` plan's rank is the replica: ``step``
            faults fire after a step is applied, ``copy`` in a replica sending its state,
            ``register`` as a replica registers a checkpoint with Ray, ``restore`` in a membership's
            source restoring from storage, the others in the lead's checkpoint writes. Its
            ``hang_watchdog`` is not used: a replica that stops answering is dropped by its liveness link.

    :attr:`result_metrics`, set by the train function (the lead's count), are reported with the
    final checkpoint, with the run's goodput (``Result.metrics``), as ``Checkpointer.finish``'s.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, lr_scheduler: Any | None = None,
                 grad_scaler: Any | None = None, data: MicroBatchSource | None = None,
                 extras: Mapping[str, Stateful] | None = None, micro_batches: int, timeout_s: float = 30.0,
                 config: CheckpointConfig = CheckpointConfig()):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        self.optimizer, self.lr_scheduler, self.grad_scaler = optimizer, lr_scheduler, grad_scaler
        self.micro_batches, self.seed = micro_batches, config.seed
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.step = 0
        self.finished = False
        self.result_metrics: dict[str, Any] = {}  # reported with the final checkpoint (the lead's)
        self._params = [p for p in model.parameters()]
        self._sizes = [p.numel() for p in self._params]
        self._buffers = [b for b in model.buffers()]
        self._buffer_sizes = [b.numel() for b in self._buffers]
        row = sum(self._sizes) + sum(self._buffer_sizes) + 1  # the gradient, the buffers' change, the loss
        exact = torch.zeros(row, dtype=torch.bool)  # integer buffers: micro-batch 0's change
        offset = sum(self._sizes)
        for buffer, size in zip(self._buffers, self._buffer_sizes):
            exact[offset:offset + size] = not buffer.is_floating_point()
            offset += size
        ctx = ray.train.get_context()
        self.replica = ctx.get_world_rank()
        self._replicas = ctx.get_world_size()
        gradients = functools.reduce(torch.promote_types, (p.dtype for p in self._params))  # not the default dtype
        self._exchange = MicroBatchExchange(row, micro_batches, exact, replicas=self._replicas, dtype=gradients)
        self._data = data
        self._components = TrainingComponents(model, optimizer, lr_scheduler, grad_scaler, data, extras)
        self._token = f"{self.replica}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        storage = config.storage or RunStorage.from_ray_context()
        self._config = config
        self._faults = FaultInjector.from_plan(config.faults, self.replica, storage.filesystem, storage.experiment_path)
        self._lead: Lead | None = None  # this replica's checkpoints and ledger, once it leads
        self._lifecycle = Lifecycle([SpareWorkerRequest()] if spares_enabled() else [])  # this replica's hooks
        self._offers = Offers(storage)
        self._registrations = Registrations(storage.filesystem)
        self._membership: Membership | None = None  # the one this replica took (its link's once formed)
        self._reforms_without_a_step = 0
        self._holds_state = False  # restored from storage, or copied from a replica that held it

    # --- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> "SurvivingReplicas":
        self._link = MembershipLink(self.replica, self._token, self.timeout, self._faults)
        membership = self._link.join(self._offers.registered_step)
        if membership.finished:
            self.step, self.finished = membership.step, True
            return self
        if not self._take(membership):
            self._change_membership()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        error = exc
        try:
            if error is None:
                self._finish()
        except BaseException as err:
            error = err
            raise
        finally:
            if error is None:
                self._registrations.close()
            if self._lead is not None:
                self._lead.close(error)
            self._link.close()

    # --- training -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Replicas training now."""
        return len(self._membership.members)

    @property
    def members(self) -> tuple[int, ...]:
        """The replicas (their Ray Train world ranks) training now, in rank order."""
        return self._membership.members

    @property
    def is_lead(self) -> bool:
        """Whether this replica saves the checkpoints and records the run's progress."""
        return self._membership is not None and self._membership.lead == self.replica

    def progress(self, phase: str) -> None:
        """Say this replica is busy with ``phase`` between two steps, as ``Checkpointer.progress``
        (what the lead's lifecycle hooks hear; a replica is judged by its liveness link, not by progress)."""
        if self._lead is not None:
            self._lead.progress(phase)

    @property
    def sent_bytes(self) -> int:
        """The bytes this replica sent in the exchanges of its steps so far (gloo's framing aside)."""
        return self._exchange.sent_bytes

    def train_step(self, loss_of: LossOf) -> float:
        """Train global batch ``self.step`` among the live replicas (again, after losing one) and
        apply it; returns its mean loss over the global batch."""
        self._faults.fire("step", self.step)  # "after step N": once the train function went on from it
        while True:
            started = time.time()
            if self.is_lead:
                self._link.lead_begins(self.step)
            controls = self._gradients(loss_of)
            try:
                if self._faults.unreachable:  # an injected partition: what gloo would find, at once
                    self._link.raise_if_cut_off()
                if not self.is_lead:
                    self._link.wait_for_the_lead(self.step)
                reduced, controls = self._exchange.reduce(self._link.group, self._membership.rank(self.replica),
                                                          controls, self._link.wait)
            except RuntimeError as err:  # a replica is gone: gloo's connections to it broke, or the coordinator says
                logger.warning("Step %d dropped on %d replicas (%s); continuing without the lost one",
                               self.step + 1, self.world_size, str(err).splitlines()[0][:200])
                self._record(EventKind.STEP_DISCARDED, step=self.step + 1, t_start=started,
                             world_size=self.world_size)
                self._change_membership()
                continue
            loss = self._apply(reduced)
            offered = int(controls[self._membership.rank(self._membership.lead), 0]) - 1
            if offered >= 0:
                self._register(offered)
            self._lifecycle.step_finished(self.step)
            if self.is_lead:
                self._lead.step_finished(started)
            if controls[0, 1] > 0:  # a replacement is waiting: take it in at this step boundary
                self._change_membership()
            return loss

    def _gradients(self, loss_of: LossOf) -> torch.Tensor:
        """Fill the exchange's rows of this replica, one per micro-batch it computes (its gradient,
        the change its forward made to the buffers, then its loss), the buffers left as the step
        found them. Returns its controls: the step of the durable checkpoint to register with Ray
        after this step, plus one (the lead offers its oldest one Ray lacks while every replica
        trains; 0: none), and whether a replacement waits (rank 0 looks)."""
        rank, size = self._membership.rank(self.replica), self.world_size
        rows = self._exchange.rows(size)
        controls = torch.zeros(CONTROLS, dtype=torch.int64)
        if self._data is not None:
            self._data.assign_micro_batches(self.step, rank, size, self.micro_batches)
        with torch.no_grad():
            start = [buffer.clone() for buffer in self._buffers]
        for slot, k in enumerate(range(rank, self.micro_batches, size)):
            reseed_rng(self.seed, self.step, k)
            self.optimizer.zero_grad(set_to_none=True)
            self._set_buffers(start)  # every micro-batch's forward starts from the step's buffers
            loss = loss_of(self.step, k)
            (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()
            row = rows[slot]
            offset = 0
            for param, size_ in zip(self._params, self._sizes):
                row[offset:offset + size_] = param.grad.reshape(-1) if param.grad is not None else 0.0
                offset += size_
            with torch.no_grad():
                for buffer, before, size_ in zip(self._buffers, start, self._buffer_sizes):
                    row[offset:offset + size_] = (buffer - before).reshape(-1)
                    offset += size_
            row[-1] = loss.detach()
        self._set_buffers(start)
        if self.is_lead and self._offers.unregistered and self.world_size == self._replicas:
            controls[0] = 1 + self._offers.unregistered[0][0]
        if rank == 0 and self._link.joiners_waiting():
            controls[1] = 1
        return controls

    def _set_buffers(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for buffer, value in zip(self._buffers, values):
                buffer.copy_(value)

    def _apply(self, reduced: torch.Tensor) -> float:
        """Step with the exchange's mean gradient (a view of it where the parameter is on the host, of
        the rows' dtype) and move the buffers by the mean of their change (integer ones by micro-batch 0's)."""
        offset = 0
        for param, size in zip(self._params, self._sizes):
            param.grad = reduced[offset:offset + size].view_as(param).to(param.device, param.dtype)
            offset += size
        with torch.no_grad():
            for buffer, size in zip(self._buffers, self._buffer_sizes):
                buffer.add_(reduced[offset:offset + size].view_as(buffer).to(buffer.device, buffer.dtype))
                offset += size
        if self.grad_scaler is not None:  # the same gradient on every replica: the same skip and scale
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step += 1
        self._reforms_without_a_step = 0
        return float(reduced[-1])

    # --- membership ---------------------------------------------------------------------

    def _change_membership(self) -> None:
        """Re-form with the replicas that remain (and those waiting to join), again if one more is lost."""
        while True:
            self._reforms_without_a_step += 1
            if self._reforms_without_a_step > MAX_REFORMS_WITHOUT_A_STEP:
                raise RuntimeError(f"replica {self.replica} re-formed its group {MAX_REFORMS_WITHOUT_A_STEP} times "
                                   f"without training a step (at step {self.step}): giving up rather than looping")
            if self._take(self._link.reform(self.step, self._holds_state)):
                return

    def _take(self, membership: Membership) -> bool:
        """Enter ``membership`` (restoring from storage first when that is this replica's part);
        False when a replica was lost while its group formed."""
        previous, self._membership = self._membership, membership
        if membership.ray_registered is not None:
            self._offers.skipped_again(membership.ray_registered, self.is_lead)
        self._link.membership = membership
        if membership.from_storage and membership.source == self.replica:
            self._restore_from_storage()
            self._link.restored()
        try:
            if membership.from_storage:
                self._link.wait_for_the_restore()
            self._enter(membership, previous)
            return True
        except RuntimeError as err:  # gloo's error, ReplicaLostError or FormationError
            logger.warning("Membership %d lost a replica as it formed (%s)", membership.epoch,
                           str(err).splitlines()[0][:200])
            self._link.formation_failed = isinstance(err, FormationError)
            return False

    def _enter(self, membership: Membership, previous: Membership | None) -> None:
        """Form ``membership``'s gloo group (taking over as the lead from a lost one, if this replica
        is its lead now); bring the members behind its source up to date."""
        if self.is_lead and self._lead is None:  # the lead was lost: this replica takes over
            self._lead = self._new_lead()
            self._lead.take_over(self.step)
        self._link.form(membership)
        copy_started = time.time()
        sent = self._copy_state() if membership.behind else 0
        if membership.behind and not membership.from_storage:  # a replacement copying from a live replica
            self._record(EventKind.PEER_RECOVERY, t_start=copy_started, step=self.step,
                         replicas=list(membership.behind), bytes=sent)
        if previous is not None and previous.epoch != membership.epoch:
            self._record(EventKind.MEMBERSHIP, step=self.step, world_size=len(membership.members),
                         lost=sorted(set(previous.members) - set(membership.members)),
                         joined=sorted(set(membership.members) - set(previous.members)))

    def _copy_state(self) -> int:
        """Bring the members behind the membership's source up to date from its memory; the bytes
        sent to each."""
        receiving = self.replica in self._membership.behind
        if receiving:
            self._holds_state = False  # its own state is overwritten from here on
        received, self.step, sent = self._link.copy_state({"state": self._components.shared_state()}, self.step)
        if received is not None:
            self._components.load_shared_state(received["state"])
        if receiving:
            self._holds_state = True
        return sent

    # --- checkpoints --------------------------------------------------------------------

    def _new_lead(self) -> Lead:
        """This replica's lead part: it reads, writes and deletes the run's checkpoints, and records
        the run's progress, from here on."""
        return Lead(self._components, self._config, self._faults, self._offers, self._replicas)

    def _restore_from_storage(self) -> None:
        """Resume from the newest complete checkpoint, if any (else the state this process built),
        under a new attempt number: the recomputed steps' checkpoints never take a committed name.
        The others wait meanwhile; its progress (:func:`~ray_resilient.watchdog.progress.note_progress`)
        tells them it gets on."""
        started = time.time()
        published = 0.0

        def publish_progress() -> None:  # a store round trip a second at most
            nonlocal published
            if time.monotonic() - published >= RESTORE_PROGRESS_EVERY_S:
                published = time.monotonic()
                self._link.restore_progress()

        with listening_to_progress(publish_progress):
            if self._lead is None:
                self._lead = self._new_lead()
            self.step = self._lead.restore()
        self._holds_state = True
        logger.info("Replica %d restored step %d in %.3fs for replicas %s", self.replica, self.step,
                    time.time() - started, self._membership.members)

    def _finish(self) -> None:
        """The run's end: the lead's final checkpoint durable (:class:`CheckpointSaveError` if it
        cannot be made so, on every replica), the others waiting for it (a lead lost before it
        finished: they re-form, and their new lead finishes); then every replica registers the
        checkpoints Ray lacks, the final one last, once a process of every replica is up: a
        replacement Ray started after the last step (:attr:`finished` when it joined) registers
        them with the others."""
        while True:
            if self.is_lead and not self.finished:
                self._finish_as_lead()
            end = ray.get(self._link.coordinator.wait_finished.remote())
            if end is not None:
                break
            # The lead was lost before it finished: the replicas left (all past the last step) re-form,
            # and their new lead finishes (its final checkpoint may already be durable).
            self._change_membership()
        if end.error is not None:
            raise FinalSaveFailed(end.error)
        for step in end.registrations:
            self._register(step, end.metrics if step == end.registrations[-1] else None)
        self.finished = True

    def _finish_as_lead(self) -> None:
        """The lead's part of :meth:`_finish`: the final checkpoint durable, a process of every
        replica up, then the coordinator told the checkpoints to register (the final one last)."""
        try:
            metrics = self._lead.finish(self.result_metrics)
        except FinalSaveFailed as err:
            ray.get(self._link.coordinator.finish.remote(RunEnd(self.step, error=str(err))))
            raise
        # By the connections, not the membership: a replica killed after the last step is still a member,
        # and its replacement waits to join.
        coordinator = self._link.coordinator
        everyone, ray_registered = ray.get(coordinator.wait_for_every_replica.remote(FINAL_REPLACEMENT_WAIT_S))
        if ray_registered is not None:
            self._offers.skipped_again(ray_registered, self.is_lead)
        unregistered = self._offers.unregistered
        to_register = [step for step, _ in unregistered] if everyone else []
        if not everyone and unregistered:
            logger.warning("The final checkpoint (step %d) is durable but not registered with Ray: a replica "
                           "was still missing %.0f s after the end", self.step, FINAL_REPLACEMENT_WAIT_S)
        ray.get(self._link.coordinator.finish.remote(RunEnd(self.step, None, tuple(to_register), metrics)))

    def _register(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        """This replica's part of registering the lead's durable checkpoint of ``step`` with Ray
        (every replica calls it at the same point), reported with ``metrics``."""
        self._faults.fire("register", step)
        path = self._offers.take(step, self.is_lead)
        self._registrations.submit({**(metrics or {}), "step": step}, path)
        self._record(EventKind.REGISTERED, step=step)

    def _record(self, kind: EventKind, **fields: Any) -> None:
        """A ledger event of the run's progress, recorded by the lead only."""
        if self._lead is not None:
            self._lead.event(kind, **fields)

