"""Asynchronous sharded saves: the loop pays for the staging copy, a background thread does the rest.

One save is in flight at a time. The staged buffers are cached by a single reused stager, so a
new save may only start once the previous one has finished writing: staging into buffers that
are still being written would silently corrupt the earlier checkpoint.

All checkpoint collectives run on a dedicated gloo process group, from the single background
thread, in save order: sharing the training group with DCP's collectives deadlocks (seen with
DDP on gloo), and a single thread keeps the collective order identical on every rank.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ray_resilient.checkpoint.collectives import all_ranks_agree
from ray_resilient.checkpoint.layout import delete_partial_checkpoints
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.faults import FaultInjector

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """The outcome of one save, identical on every rank (the ranks agree on ``ok``)."""

    step: int
    path: str
    ok: bool
    stage_seconds: float
    durable_seconds: float
    error: str | None = None


class _ShardWriter(FileSystemWriter):
    """DCP's file writer, with the ``upload`` fault point between the shards and ``.metadata``."""

    def __init__(self, path: str, faults: FaultInjector, step: int, fire_upload_fault: bool, **kwargs: Any):
        super().__init__(path, **kwargs)
        self._faults = faults
        self._step = step
        self._fire_upload_fault = fire_upload_fault

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        if self._fire_upload_fault:
            self._faults.fire("upload", self._step)
        return written


class AsyncCheckpointWriter:
    """Writes staged state dicts as DCP checkpoints in the background, one at a time."""

    def __init__(self, storage: CheckpointStorage, rank: int, faults: FaultInjector):
        self.storage = storage
        self.rank = rank
        self.faults = faults
        distributed = dist.is_available() and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if distributed else None
        cuda = torch.cuda.is_available()
        # Synchronous staging: when stage() returns, training may modify the live tensors.
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ray_resilient_ckpt")
        self._pending: Future[SaveResult] | None = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The dedicated gloo group (None when not distributed); idle while no save is in flight."""
        return self._group

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._pending is not None

    def save(self, state_dict: dict[str, Any], step: int, name: str) -> None:
        """Stage ``state_dict`` (the training loop's only cost) and write it in the background
        as the checkpoint directory ``name``."""
        if self._pending is not None:
            raise RuntimeError("a save is still in flight: call wait() before starting the next one")
        started = time.monotonic()
        self.faults.fire("staging", step)
        staged = self._stager.stage(state_dict)
        stage_seconds = time.monotonic() - started
        self._pending = self._executor.submit(self._write, staged, step, name, started, stage_seconds)

    def wait(self) -> SaveResult | None:
        """Block until the save in flight (if any) is durable or failed, and return its result."""
        if self._pending is None:
            return None
        result = self._pending.result()
        self._pending = None
        return result

    def abandon(self) -> None:
        """Stop without waiting (the process is failing): the save in flight stays partial."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._pending = None

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        self._stager.close()
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
                ok = self._agree(self.rank != 0 or attempt("uploading .metadata", lambda: self.storage.upload_metadata(name, 0)))
        if self.storage.is_remote:
            shutil.rmtree(self.storage.write_dir(name, self.rank), ignore_errors=True)
        durable_seconds = time.monotonic() - started
        if ok:
            logger.info("Checkpoint %s durable %.3fs after the save began", path, durable_seconds)
            self.faults.fire("durable", step)
            if self.rank == 0:
                attempt("collecting partial checkpoints", lambda: delete_partial_checkpoints(
                    self.storage.filesystem, self.storage.experiment_path))
        return SaveResult(step, path, ok, stage_seconds, durable_seconds, None if ok else error or "another rank failed")

    def _write_shards(self, staged: dict[str, Any], step: int, name: str) -> None:
        writer = _ShardWriter(
            self.storage.write_dir(name, self.rank),
            self.faults,
            step,
            fire_upload_fault=not self.storage.is_remote,
            # Local staging for an upload needs no fsync; a final local checkpoint does.
            sync_files=not self.storage.is_remote,
        )
        dcp.save(staged, storage_writer=writer, process_group=self._group)

    def _upload_shards(self, step: int, name: str) -> None:
        self.storage.upload_shards(name, self.rank)
        self.faults.fire("upload", step)
