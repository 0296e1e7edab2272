"""Registering a durable checkpoint with Ray Train, so that ``ray.train.get_checkpoint()``,
``Result.checkpoint`` and ``CheckpointConfig.num_to_keep`` know it.

A checkpoint reaches Ray only once every shard of it is durable, and a save that failed never
reaches it. So registration is a report made after the save finished, with
``CheckpointUploadMode.ASYNC`` and an identity upload function: the files are already where Ray
keeps checkpoints, and putting the result on Ray's size-1 result queue (drained by the controller
every ~2 s) happens on Ray's upload thread, not on the caller's. (Reporting at save time would
hand Ray an unfinished checkpoint, and an ASYNC ``checkpoint_upload_fn`` cannot withdraw a failed
one: anything it raises kills the training thread.)

Each report is a barrier across the worker group in Ray: every worker registers the same number of
times, in the same order. Ray takes the checkpoint from whichever worker passed one (they must
agree) and the metrics of rank 0.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

import pyarrow.fs as pafs
import ray.train
from ray.train import Checkpoint, CheckpointUploadMode

from ray_resilient._ray_internals import train_run_storage
from ray_resilient.storage.run import RunStorage

if TYPE_CHECKING:
    from ray_resilient.checkpoint.layout import CheckpointDir
    from ray_resilient.checkpoint.restore import RestorePlan
    from ray_resilient.checkpoint.state import TrainState
    from ray_resilient.checkpoint.writer import SaveResult

logger = logging.getLogger(__name__)


def reaches_ray(storage: RunStorage) -> bool:
    """Whether checkpoints in ``storage`` can be registered with Ray: Ray takes only checkpoints in
    its run directory (``RunConfig(storage_path, name)``). Elsewhere (a ``CheckpointConfig(storage=)``
    of the job's own) they are written, listed and restored alike, and Ray is told only the metrics,
    which a warning says once."""
    filesystem, run_dir = train_run_storage()
    if storage.experiment_path.rstrip("/") == run_dir.rstrip("/") and storage.filesystem.equals(filesystem):
        return True
    logger.warning("Checkpoints go to %s, not Ray's run directory %s: Ray will not register them "
                   "(Result.checkpoint, get_checkpoint(), num_to_keep); restores find them all the same",
                   storage.experiment_path, run_dir)
    return False


def _already_durable(checkpoint: Checkpoint, _dir_name: str) -> Checkpoint:
    return checkpoint


def register_durable(metrics: Mapping[str, Any], path: str | None = None,
                     filesystem: pafs.FileSystem | None = None) -> None:
    """This worker's part of one registration: the durable checkpoint at ``path`` on ``filesystem``
    (None: a worker that holds no part of it) with ``metrics``."""
    checkpoint = Checkpoint(path, filesystem=filesystem) if path is not None else None
    ray.train.report(
        dict(metrics),
        checkpoint=checkpoint,
        checkpoint_dir_name=path.rsplit("/", 1)[-1] if path is not None else None,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        checkpoint_upload_fn=_already_durable,
        delete_local_checkpoint_after_upload=False,
    )


class RayReportRegistrar:
    """The mainline's :class:`~ray_resilient.checkpoint.loop.Registrar`: a durable checkpoint is
    reported to Ray as soon as every rank collected it (every rank reports, at the same point).
    A restore from a checkpoint Ray lacks (durable before a crash, never registered) hands it to Ray
    at once, so that ``get_checkpoint()``, ``Result.checkpoint`` and ``num_to_keep`` all know it."""

    def __init__(self, storage: RunStorage):
        self._filesystem = storage.filesystem
        self._reaches_ray = reaches_ray(storage)

    def opened(self, plan: RestorePlan, resumed: tuple[CheckpointDir, TrainState] | None) -> int | None:
        if resumed is None or not self._reaches_ray:
            return None
        checkpoint, saved = resumed
        registered = ray.train.get_checkpoint()
        older = {c.path for c in plan.candidates if c < checkpoint}
        if registered is not None and registered.path not in older:
            return None
        register_durable({"step": saved.step, "epoch": saved.epoch}, checkpoint.path, self._filesystem)
        return saved.step

    def durable(self, result: SaveResult, metrics: Mapping[str, Any]) -> bool:
        register_durable(metrics, result.path if self._reaches_ray else None, self._filesystem)
        return self._reaches_ray

    def final(self, metrics: Mapping[str, Any]) -> None:
        ray.train.report(dict(metrics))
