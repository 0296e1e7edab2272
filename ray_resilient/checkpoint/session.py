"""One writer's checkpoint session on a run directory: the parts the checkpoint loop
(:mod:`~ray_resilient.checkpoint.loop`) drives.

- The run's lease (:mod:`~ray_resilient.checkpoint.lease`: one writer per run), its next
  generation taken when the session opens (the attempt number of the saves that follow), checked
  before and after every commit.
- Opening: the complete checkpoints found (newest first), the partial ones older than the newest
  complete one deleted.
- The asynchronous writer (:class:`~ray_resilient.checkpoint.writer.AsyncCheckpointWriter`).
- A save that comes due while every staging set is still being written is deferred, a step at a
  time, never waited for on the training thread. Once the oldest save in flight has been writing
  for more than ``save_timeout_s`` (a hung mount, a stuck upload), a due save that cannot start
  fails instead, and counts towards the escalation below: a hung write ends the attempt
  (``CheckpointSaveError``; Ray restarts the worker group) instead of deferring every save forever.
- Finished saves counted, too many failed in a row escalated
  (:class:`~ray_resilient.checkpoint.save_outcomes.SaveOutcomes`).
- Closing: the saves in flight written and the lease released, or after a failure abandoned (they
  stay partial) and the lease left for a restart to take back. When the run ends (closed without
  an error, or with an unrecoverable one), the node's checkpoint copies
  (:mod:`~ray_resilient.checkpoint.node_copy`) are deleted.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch.distributed as dist

from ray_resilient._ray_internals import train_run_id
from ray_resilient.checkpoint.errors import UnrecoverableRunError
from ray_resilient.checkpoint.layout import delete_partial_checkpoints, list_checkpoints
from ray_resilient.checkpoint.lease import TTL_S, RunLease
from ray_resilient.checkpoint.node_copy import drop_node_copies
from ray_resilient.checkpoint.restore import RestorePlan, find_complete_checkpoints
from ray_resilient.checkpoint.save_outcomes import CheckpointSaveError, SaveOutcomes
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import AsyncCheckpointWriter, SaveResult
from ray_resilient.faults import FaultInjector

logger = logging.getLogger(__name__)


class CheckpointSession:
    """The checkpoints one rank (or survivor mode's lead) writes to ``storage`` (see the module docstring).

    Args:
        storage, rank, faults, staging_buffers, write_threads, on_durable: the writer's
            (:class:`~ray_resilient.checkpoint.writer.AsyncCheckpointWriter`).
        max_failed_saves_in_a_row: :class:`~ray_resilient.checkpoint.save_outcomes.SaveOutcomes`'.
        save_timeout_s: how long a save may be in flight before the due saves it holds up fail.
        lease_ttl_s: how long the run's lease may go unrenewed before another driver takes it over
            (:class:`~ray_resilient.checkpoint.lease.RunLease`'s ``ttl_s``).
        run_id: the run holding the lease (default: this Ray Train run's).
    """

    def __init__(self, storage: CheckpointStorage, rank: int, faults: FaultInjector, *, staging_buffers: int = 2,
                 write_threads: int = 4, max_failed_saves_in_a_row: int = 3, save_timeout_s: float = 600.0,
                 lease_ttl_s: float = TTL_S, on_durable: Callable[[int, float], None] = lambda step, t: None,
                 run_id: str | None = None):
        if not save_timeout_s > 0:
            raise ValueError(f"save_timeout_s must be > 0, got {save_timeout_s!r}")
        self.storage = storage
        self.save_timeout_s = save_timeout_s
        self._outcomes = SaveOutcomes(max_failed_saves_in_a_row)
        self._lease = RunLease(storage.filesystem, storage.experiment_path, run_id or train_run_id(), ttl_s=lease_ttl_s)
        self._writer = AsyncCheckpointWriter(storage, rank, faults, staging_buffers=staging_buffers,
                                             write_threads=write_threads, commit=self._lease.commit,
                                             on_durable=on_durable)
        self.deferred = False  # a due save waits for a free set of staging buffers
        self.deferred_saves = 0  # due saves that waited (writes slower than the interval)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The writer's gloo group of every rank (None for one rank): for the restore's collectives."""
        return self._writer.group

    @property
    def in_flight(self) -> int:
        """Saves started and not collected."""
        return self._writer.in_flight

    @property
    def failed(self) -> int:
        """Saves that did not become durable."""
        return self._outcomes.failed

    def check_lease(self) -> None:
        """``RunLeaseLostError`` once this run no longer holds the run directory (rank 0)."""
        self._lease.check()

    def finished(self) -> int:
        """How many of the oldest saves in flight have finished on this rank."""
        return self._writer.finished()

    def collect(self, count: int) -> list[SaveResult]:
        """The results of the ``count`` oldest saves (finished), in order."""
        return self._writer.collect(count)

    def save(self, state: dict[str, Any], step: int, name: str, tick: Callable[[], None] | None = None) -> None:
        """Stage ``state`` (``tick`` per tensor) and write it as checkpoint ``name`` in the background."""
        self._writer.save(state, step, name, tick)

    def record(self, result: SaveResult) -> None:
        """Count a finished save (:class:`CheckpointSaveError` after too many failed in a row)."""
        self._outcomes.record(result)

    def open(self, registered_path: str | None) -> RestorePlan:
        """Take the run's lease's next generation, the attempt number of the saves from here on
        (``RunLeaseHeldError`` when another driver's run holds it), find the complete checkpoints
        (``registered_path``: Ray's, ``get_checkpoint()``) and delete the partial ones older than the
        newest complete one. On one rank (rank 0, or the lead)."""
        listed = list_checkpoints(self.storage.filesystem, self.storage.experiment_path)  # listed again once held
        attempt = self._lease.acquire(after=max((c.attempt for c in listed), default=-1))
        plan = find_complete_checkpoints(self.storage, registered_path, attempt)
        delete_partial_checkpoints(self.storage.filesystem, self.storage.experiment_path)
        return plan

    def may_save(self, step: int) -> bool:
        """Whether a save due at ``step`` can be staged now. If not, it is deferred (counted once,
        logged) and due again at the next step; or, when the oldest save in flight is older than
        ``save_timeout_s``, it fails (``CheckpointSaveError`` once too many failed in a row)."""
        if self._writer.can_stage:
            self.deferred = False
            return True
        oldest_step, age = self._writer.oldest_in_flight()
        if age > self.save_timeout_s:
            self.deferred = False
            self._outcomes.record(SaveResult(step, "", False, 0.0, 0.0, error=(
                f"not started: the save of step {oldest_step} has been writing for {age:.0f} s, more than "
                f"save_timeout_s={self.save_timeout_s:g} (is the storage hung?)")))
            return False
        if not self.deferred:
            self.deferred_saves += 1
            logger.info("Checkpoint at step %d deferred: the previous saves are still being written", step)
        self.deferred = True
        return False

    def collect_all(self) -> list[SaveResult]:
        """Wait for every save in flight; :class:`CheckpointSaveError` when one is still writing
        ``save_timeout_s`` after it began (a hung write would otherwise hold the run forever)."""
        try:
            return self._writer.collect(timeout_s=self.save_timeout_s)
        except TimeoutError:
            step, age = self._writer.oldest_in_flight()
            raise CheckpointSaveError(
                f"the save of step {step} has been writing for {age:.0f} s, more than save_timeout_s="
                f"{self.save_timeout_s:g}: the storage looks hung; stopping this attempt") from None

    def _run_ended(self) -> None:
        if self.storage.is_remote:  # the node's copy of a checkpoint is for a restart of the run
            drop_node_copies(self.storage.local_dir)

    def close(self, error: BaseException | None = None) -> None:
        """Wait for the saves in flight and release the lease; after ``error``, abandon the saves in
        flight and leave the lease to a restart of the run (released when ``error`` ends the run)."""
        if error is None:
            self._writer.close()
            self._lease.release()
            self._run_ended()
            return
        self._writer.abandon()
        if isinstance(error, UnrecoverableRunError):
            self._lease.release()
            self._run_ended()
        else:  # a restart of this run takes the lease back; if none comes, it expires
            self._lease.stop()
