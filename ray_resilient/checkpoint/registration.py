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

from typing import Any, Mapping

import pyarrow.fs as pafs
import ray.train
from ray.train import Checkpoint, CheckpointUploadMode


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
