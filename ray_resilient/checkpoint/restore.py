"""Finding and loading the newest complete checkpoint, falling back past ones that fail to load."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ray_resilient.checkpoint.collectives import all_ranks_agree
from ray_resilient.checkpoint.layout import CheckpointDir, list_checkpoints
from ray_resilient.checkpoint.state import TRAIN_STATE, TrainingComponents, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestorePlan:
    """What rank 0 found on storage, broadcast so that every rank acts on the same view."""

    candidates: list[CheckpointDir]  # complete checkpoints, newest first
    partial: list[CheckpointDir]
    next_attempt: int


def find_complete_checkpoints(storage: CheckpointStorage, registered_path: str | None) -> RestorePlan:
    """Every complete checkpoint of the run, newest first.

    This includes the one Ray registered (``ray.train.get_checkpoint()``) and any newer one
    that became durable but was not registered before a crash: the listing of the run's
    storage sees both, so the newest complete checkpoint is never missed.
    """
    found = list_checkpoints(storage.filesystem, storage.experiment_path)
    complete = [c for c in reversed(found) if c.complete]
    if registered_path is not None and registered_path not in {c.path for c in found}:
        logger.warning("Ray's registered checkpoint %s is not a ray_resilient checkpoint; ignored", registered_path)
    next_attempt = 1 + max((c.attempt for c in found), default=-1)
    return RestorePlan(complete, [c for c in found if not c.complete], next_attempt)


def load_checkpoint(
    storage: CheckpointStorage,
    path: str,
    components: TrainingComponents,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[TrainState, list[str]]:
    """Load one checkpoint into the live objects. Returns its train state and warnings."""
    header = {TRAIN_STATE: TrainState().state_dict()}
    dcp.load(header, storage_reader=storage.reader(path), process_group=group)
    saved = TrainState()
    saved.load_state_dict(header[TRAIN_STATE])
    state = components.state_to_load(saved, rank, world_size)
    dcp.load(state, storage_reader=storage.reader(path), process_group=group)
    return saved, components.apply_loaded(state, saved, rank, world_size)


def load_newest_loadable(
    storage: CheckpointStorage,
    candidates: list[CheckpointDir],
    components: TrainingComponents,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[CheckpointDir, TrainState] | None:
    """Load the newest candidate that loads on every rank; warn about each one skipped."""
    for ckpt in candidates:
        started = time.monotonic()
        error = None
        try:
            saved, warnings = load_checkpoint(storage, ckpt.path, components, rank, world_size, group)
        except BaseException as err:  # DCP's CheckpointException derives from BaseException.
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            error = err
        if all_ranks_agree(group, error is None):
            for warning in warnings:
                logger.warning("Restored %s: %s", ckpt.path, warning)
            logger.info("Restored %s (step %d) in %.3fs", ckpt.path, saved.step, time.monotonic() - started)
            return ckpt, saved
        logger.warning(
            "Checkpoint %s failed to load (%s); falling back to the previous complete checkpoint",
            ckpt.path,
            f"{type(error).__name__}: {error}" if error is not None else "failed on another rank",
        )
    return None
