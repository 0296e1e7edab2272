"""Asynchronous sharded saves: the loop pays for the staging copy, a background thread does the rest.

A save stages the state into a free set of host buffers (:class:`~ray_resilient.checkpoint.staging.HostStager`)
and returns; one background thread writes the staged sets in save order. With two sets (the
default) the next save stages while the previous one is still being written, so the loop does
not wait for storage; only when every set is still being written can a save not start (the
session then defers it, see :class:`~ray_resilient.checkpoint.session.CheckpointSession`).
A set is never staged into while its write is in flight: that would silently corrupt the
checkpoint being written. Host memory: ``staging_buffers`` times this rank's share of the state.

All checkpoint collectives run on a dedicated gloo process group, from the single background
thread, in save order: sharing the training group with DCP's collectives deadlocks (seen with
DDP on gloo), and a single thread keeps the collective order identical on every rank.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from ray_resilient._torch_internals import written_file
from ray_resilient.checkpoint.collectives import all_ranks_agree
from ray_resilient.checkpoint.integrity import record_checksums
from ray_resilient.checkpoint.layout import (
    METADATA_FILE, delete_partial_checkpoints, parse_checkpoint_dir_name, refuse_complete,
)
from ray_resilient.checkpoint.lease import check_fence
from ray_resilient.checkpoint.node_copy import keep_saved
from ray_resilient.checkpoint.staging import HostStager
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.faults import FaultInjector

logger = logging.getLogger(__name__)

Commit = Callable[[Callable[[], None], Callable[[], None]], None]  # (write the marker, withdraw it)


@dataclass(frozen=True)
class SaveResult:
    """The outcome of one save, identical on every rank (the ranks agree on ``ok``)."""

    step: int
    path: str
    ok: bool
    stage_seconds: float
    durable_seconds: float  # from the start of the save (staging included) to every rank's files committed
    error: str | None = None
    stall_seconds: float = 0.0  # how long the training loop stopped for it (set by the Checkpointer)
    stall_phases: Mapping[str, float] = field(default_factory=dict)  # that stall by phase (Checkpointer)


@dataclass(frozen=True)
class _Pending:
    """A save in flight: its write, the staging set it holds, its step and start (monotonic s)."""

    future: Future[SaveResult]
    stager: HostStager
    step: int
    started: float


class _ShardWriter(FileSystemWriter):
    """DCP's file writer that records its shards' checksums (:mod:`~ray_resilient.checkpoint.integrity`),
    with the ``upload`` fault point between the shards and ``.metadata``, and the coordinator's
    write of ``.metadata`` made through ``commit`` (when given)."""

    def __init__(self, path: str, rank: int, faults: FaultInjector, step: int, fire_upload_fault: bool,
                 commit: Commit | None, **kwargs: Any):
        super().__init__(path, **kwargs)
        self._rank = rank
        self._faults = faults
        self._step = step
        self._fire_upload_fault = fire_upload_fault
        self._commit = commit

    def finish(self, metadata, results):
        if self._commit is None:
            return super().finish(metadata, results)
        marker = os.path.join(str(self.path), METADATA_FILE)
        self._commit(lambda: super(_ShardWriter, self).finish(metadata, results), lambda: os.remove(marker))

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        files = [written_file(result) for result in written.wait()]
        record_checksums(str(self.path), self._rank, files, sync=self.sync_files)
        if self._fire_upload_fault:
            self._faults.fire("upload", self._step)
        return written


class AsyncCheckpointWriter:
    """Writes staged state dicts as DCP checkpoints in the background, in save order.

    Args:
        storage: where checkpoints go.
        rank: this rank.
        faults: the fault-injection plan.
        staging_buffers: sets of reused host buffers (1 or more): how many saves can be staged
            or written at once.
        write_threads: files each rank writes in parallel (DCP's ``thread_count``; 4 wrote 1.5x
            faster than 1 on a 2-core VM, ``benchmarks/gpu_checkpoint.py``).
        commit: how rank 0 commits a checkpoint: called with the write of ``.metadata`` and its
            withdrawal (the run's lease, :meth:`~ray_resilient.checkpoint.lease.RunLease.commit`);
            what it raises fails the save.
        on_durable: called with the step and the wall time on the writer's thread as soon as every
            rank made a save durable, before it is collected (a process killed before the next
            collection still recorded it).
    """

    def __init__(self, storage: CheckpointStorage, rank: int, faults: FaultInjector, *,
                 staging_buffers: int = 2, write_threads: int = 4, commit: Commit = lambda write, withdraw: write(),
                 on_durable: Callable[[int, float], None] = lambda step, t: None):
        if staging_buffers < 1 or write_threads < 1:
            raise ValueError(f"staging_buffers and write_threads must be >= 1, got {staging_buffers}, {write_threads}")
        self.storage = storage
        self.rank = rank
        self.faults = faults
        self.write_threads = write_threads
        self.commit = commit
        self.on_durable = on_durable
        distributed = dist.is_available() and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if distributed else None
        self._stagers = [HostStager() for _ in range(staging_buffers)]  # pinned when the state is on CUDA
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ray_resilient_ckpt")
        self._pending: deque[_Pending] = deque()  # oldest first

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The dedicated gloo group (None when not distributed); idle while no save is in flight."""
        return self._group

    @property
    def in_flight(self) -> int:
        """Saves started and not yet collected."""
        return len(self._pending)

    @property
    def can_stage(self) -> bool:
        """Whether a set of staging buffers is free, so that :meth:`save` can start."""
        return len(self._pending) < len(self._stagers)

    @property
    def staged_bytes(self) -> int:
        """Host memory held by the staging buffers."""
        return sum(stager.nbytes for stager in self._stagers)

    def finished(self) -> int:
        """How many of the oldest saves in flight have finished on this rank (without waiting)."""
        count = 0
        for pending in self._pending:
            if not pending.future.done():
                break
            count += 1
        return count

    def oldest_in_flight(self) -> tuple[int, float] | None:
        """The step of the oldest save in flight and how long ago it began (s); None when none is."""
        if not self._pending:
            return None
        oldest = self._pending[0]
        return oldest.step, time.monotonic() - oldest.started

    def save(self, state_dict: dict[str, Any], step: int, name: str,
             progress: Callable[[], None] | None = None) -> None:
        """Stage ``state_dict`` (the training loop's only cost; ``progress`` called after each
        tensor) and write it in the background as the checkpoint directory ``name``, after the
        saves before it."""
        if not self.can_stage:
            raise RuntimeError("every staging buffer set is still being written: collect() a save before the next")
        busy = {id(pending.stager) for pending in self._pending}
        stager = next(stager for stager in self._stagers if id(stager) not in busy)
        started = time.monotonic()
        self.faults.fire("staging", step)
        staged = stager.stage(state_dict, progress)
        stage_seconds = time.monotonic() - started
        future = self._executor.submit(self._write, staged, step, name, started, stage_seconds)
        self._pending.append(_Pending(future, stager, step, started))

    def collect(self, count: int | None = None, timeout_s: float | None = None) -> list[SaveResult]:
        """Wait for the ``count`` oldest saves in flight (default: all) and return their results;
        ``TimeoutError`` when one is still writing ``timeout_s`` after it began (it stays in flight)."""
        count = len(self._pending) if count is None else min(count, len(self._pending))
        results = []
        for _ in range(count):
            oldest = self._pending[0]
            wait = None if timeout_s is None else max(0.0, oldest.started + timeout_s - time.monotonic())
            results.append(oldest.future.result(timeout=wait))
            self._pending.popleft()
        return results

    def abandon(self) -> None:
        """Stop without waiting (the process is failing): saves in flight stay partial."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()

    def close(self) -> None:
        self.collect()
        self._executor.shutdown()
        for stager in self._stagers:
            stager.close()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    # --- background thread -------------------------------------------------------------

    def _agree(self, ok: bool) -> bool:
        return all_ranks_agree(self._group, ok)

    def _write(self, staged: dict[str, Any], step: int, name: str, started: float, stage_seconds: float) -> SaveResult:
        path = self.storage.checkpoint_path(name)
        error: str | None = None

        def attempt(phase: str, fn) -> bool:
            nonlocal error
            try:
                fn()
                return True
            except BaseException as err:  # DCP's CheckpointException derives from BaseException.
                if isinstance(err, (KeyboardInterrupt, SystemExit)):
                    raise
                error = f"{phase}: {type(err).__name__}: {err}"
                logger.exception("Checkpoint at step %d failed while %s", step, phase)
                return False

        ok = self._agree(attempt("writing shards", lambda: self._write_shards(staged, step, name)))
        if ok and self.storage.is_remote:
            ok = self._agree(attempt("uploading shards", lambda: self._upload_shards(step, name)))
            if ok:
                ok = self._agree(self.rank != 0 or attempt("uploading .metadata", lambda: self._commit_remote(name)))
        durable_seconds = time.monotonic() - started
        if ok:
            logger.log(logging.INFO if self.rank == 0 else logging.DEBUG, "Checkpoint %s durable %.3fs after the save "
                       "began", path, durable_seconds)
            self.on_durable(step, time.time())
            self.faults.fire("durable", step)
        if self.storage.is_remote:
            if ok:
                self._keep_node_copy(name)
            shutil.rmtree(self.storage.write_dir(name, self.rank), ignore_errors=True)
        if ok and self.rank == 0:
            attempt("collecting partial checkpoints", lambda: delete_partial_checkpoints(
                self.storage.filesystem, self.storage.experiment_path))
        return SaveResult(step, path, ok, stage_seconds, durable_seconds, None if ok else error or "another rank failed")

    def _keep_node_copy(self, name: str) -> None:
        """Keep this rank's files of the durable checkpoint ``name`` as the node's copy of it (a restart
        on this node reads them without a download); a failure costs only that."""
        try:
            keep_saved(self.storage.write_dir(name, self.rank), self.storage.local_dir, name, self.rank)
        except (OSError, ValueError) as err:
            logger.warning("Could not keep checkpoint %s's shards on this node (%s): a restore fetches them", name,
                           err)

    def _check_fence(self, name: str) -> None:
        """:class:`~ray_resilient.checkpoint.lease.RunLeaseLostError` when the lease generation that
        names this checkpoint (its attempt number) is no longer the newest: a fenced-off writer."""
        check_fence(self.storage.filesystem, self.storage.experiment_path, parse_checkpoint_dir_name(name)[1])

    def _write_shards(self, staged: dict[str, Any], step: int, name: str) -> None:
        if not self.storage.is_remote:  # DCP writes the shards straight into the run directory
            self._check_fence(name)
        refuse_complete(self.storage.filesystem, self.storage.checkpoint_path(name))
        writer = _ShardWriter(
            self.storage.write_dir(name, self.rank),
            self.rank,
            self.faults,
            step,
            fire_upload_fault=not self.storage.is_remote,
            # A remote checkpoint is committed by the upload of .metadata, not by DCP's write of it.
            commit=None if self.storage.is_remote else self.commit,
            # Local staging for an upload needs no fsync; a final local checkpoint does.
            sync_files=not self.storage.is_remote,
            thread_count=self.write_threads,
        )
        dcp.save(staged, storage_writer=writer, process_group=self._group)

    def _upload_shards(self, step: int, name: str) -> None:
        self._check_fence(name)
        self.storage.upload_shards(name, self.rank)
        self.faults.fire("upload", step)

    def _commit_remote(self, name: str) -> None:
        marker = f"{self.storage.checkpoint_path(name)}/{METADATA_FILE}"
        self.commit(lambda: self.storage.upload_metadata(name, 0), lambda: self.storage.filesystem.delete_file(marker))
