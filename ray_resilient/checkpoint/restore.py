"""Finding and loading the newest complete checkpoint.

A checkpoint that cannot be read (a shard that fails its checksum, is truncated or missing, a
read error that persists through retries) is skipped in favour of the previous complete one. A checkpoint that reads but
does not fit the job (a changed layer shape, an added or removed part, keys that differ, a data
position for another dataset) stops the restore with :class:`IncompatibleCheckpointError`:
falling back would hit the same mismatch, and starting fresh would let Ray's ``num_to_keep``
delete the run's real checkpoints. When complete checkpoints exist but none can be read, the
restore fails too (:class:`NoLoadableCheckpointError`) instead of silently starting fresh.

Loading goes stage by stage, the ranks agreeing after each, so that every rank takes the same
path: on local storage the shard checksums (:mod:`~ray_resilient.checkpoint.integrity`, each rank
a share of the files; on remote storage each file is verified as it is fetched into the node's
copy, :mod:`~ray_resilient.checkpoint.node_copy`); the train state and ``.metadata``; a check of
the job's state against ``.metadata``; the small parts (per-rank RNG, data position and buffers,
scheduler, scaler, extras); the data position (which the data object may refuse); the model and
optimizer. DCP reads the model and optimizer in place; everything else is applied only once every
rank has read everything. A checkpoint abandoned halfway leaves nothing the job runs with: the next
candidate overwrites every key, and when none loads the restore raises.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ray_resilient._torch_internals import flatten_like_dcp
from ray_resilient.checkpoint.collectives import worst_on_any_rank
from ray_resilient.checkpoint.errors import UnrecoverableRunError
from ray_resilient.checkpoint.integrity import ChecksumMismatchError, verify_checksums
from ray_resilient.checkpoint.layout import CheckpointDir, checkpoint_dir_name, list_checkpoints
from ray_resilient.checkpoint.node_copy import keep_only
from ray_resilient.checkpoint.safe_loading import WeightsOnlyLoadPlanner
from ray_resilient.checkpoint.state import (
    BUFFERS, EXTRAS, GRAD_SCALER, LR_SCHEDULER, MODEL, OPTIMIZER, RANK_STATE, TRAIN_STATE, TrainingComponents,
    TrainState, rank_key,
)
from ray_resilient.checkpoint.storage import ArrowDCPReader, CheckpointStorage
from ray_resilient.checkpoint.trust import UntrustedCheckpointError, check_world_size

logger = logging.getLogger(__name__)

READ_ATTEMPTS = 3  # a failed read is retried (transient storage errors) before the checkpoint is skipped
READ_BACKOFF_S = 0.5  # doubled after each failed read
SHARED_PARTS = (MODEL, OPTIMIZER, LR_SCHEDULER, GRAD_SCALER, EXTRAS)  # must match the job key for key
OK, UNREADABLE, INCOMPATIBLE = 0, 1, 2  # outcomes of a load stage, by severity


class IncompatibleCheckpointError(UnrecoverableRunError):
    """A complete checkpoint of the run does not fit the job: the job changed since it was written."""


class NoLoadableCheckpointError(RuntimeError):
    """The run has complete checkpoints and none of them could be read."""


@dataclass(frozen=True)
class RestorePlan:
    """What rank 0 found on storage, broadcast so that every rank acts on the same view."""

    candidates: list[CheckpointDir]  # complete checkpoints, newest first
    partial: list[CheckpointDir]
    attempt: int  # the attempt number of the saves that follow: the lease generation taken


def find_complete_checkpoints(storage: CheckpointStorage, registered_path: str | None, attempt: int) -> RestorePlan:
    """Every complete checkpoint of the run, newest first, for the saves of ``attempt``.

    This includes the one Ray registered (``ray.train.get_checkpoint()``) and any newer one
    that became durable but was not registered before a crash: the listing of the run's
    storage sees both, so the newest complete checkpoint is never missed.
    """
    found = list_checkpoints(storage.filesystem, storage.experiment_path)
    complete = [c for c in reversed(found) if c.complete]
    if registered_path is not None and registered_path not in {c.path for c in found}:
        logger.warning("Ray's registered checkpoint %s is not a ray_resilient checkpoint; ignored", registered_path)
    return RestorePlan(complete, [c for c in found if not c.complete], attempt)


def incompatibilities(metadata: Metadata, state: dict[str, Any]) -> list[str]:
    """How the job's shared state differs from a checkpoint's: parts, keys and tensor shapes."""
    flat = flatten_like_dcp({part: value for part, value in state.items() if part in SHARED_PARTS})
    saved = {key: meta for key, meta in metadata.state_dict_metadata.items() if key.split(".", 1)[0] in SHARED_PARTS}
    problems = []
    for part in SHARED_PARTS:
        ours = {key for key in flat if key.split(".", 1)[0] == part}
        theirs = {key for key in saved if key.split(".", 1)[0] == part}
        if ours and not theirs:
            problems.append(f"it has no {part}, the job has one")
        elif theirs and not ours:
            problems.append(f"it has a {part}, the job has none")
        else:
            for what, keys in (("missing from it", ours - theirs), ("not in the job", theirs - ours)):
                if keys:
                    problems.append(f"{len(keys)} {part} keys {what} (e.g. {sorted(keys)[0]!r})")
    for key in sorted(flat.keys() & saved.keys()):
        ours, theirs = flat[key], saved[key]
        if isinstance(ours, torch.Tensor) and isinstance(theirs, TensorStorageMetadata) and ours.shape != theirs.size:
            problems.append(f"{key!r} has shape {tuple(theirs.size)} in it, {tuple(ours.shape)} in the job")
    return problems


def _damaged(err: BaseException) -> bool:
    """Whether a failed read found the checkpoint damaged or untrusted, which a retry cannot fix."""
    failures = getattr(err, "failures", {})  # DCP's CheckpointException: rank -> (exception, trace)
    found = [err, *(pair[0] for pair in failures.values())]
    return any(isinstance(e, (ChecksumMismatchError, UntrustedCheckpointError)) for e in found)


def _read(reader: ArrowDCPReader, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """``dcp.load`` into ``state``, retried with backoff (DCP fails on every rank together) unless the
    checkpoint is damaged."""
    for attempt in range(READ_ATTEMPTS):
        try:
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), process_group=group)
            return
        except BaseException as err:  # DCP's CheckpointException derives from BaseException.
            if isinstance(err, (KeyboardInterrupt, SystemExit)) or attempt + 1 == READ_ATTEMPTS or _damaged(err):
                raise
            logger.warning("Reading %s failed (%s: %s); retrying", reader.path, type(err).__name__, err)
            time.sleep(READ_BACKOFF_S * 2**attempt)


def read_header(reader: ArrowDCPReader, group: dist.ProcessGroup | None = None) -> tuple[TrainState, Metadata]:
    """The checkpoint's ``.metadata`` (read safely, its byte ranges checked) and train state (its
    world size checked), before anything else of it is read."""
    metadata = reader.read_metadata()  # first: its refusal names what it refers to
    # The fields this checkpoint has: one written before a field was added still loads.
    box = {TRAIN_STATE: {key: value for key, value in TrainState().state_dict().items()
                         if f"{TRAIN_STATE}.{key}" in metadata.state_dict_metadata}}
    _read(reader, box, group)
    saved = TrainState()
    saved.load_state_dict(box[TRAIN_STATE])
    check_world_size(reader.path, saved.world_size)  # before anything is allocated per saved rank
    return saved, metadata


def _stage(group: dist.ProcessGroup | None, severity: int, fn: Callable[[], Any]) -> tuple[tuple[int, str], Any]:
    """Run one load stage on every rank; its outcome is the worst over the ranks."""
    try:
        value, outcome = fn(), (OK, "")
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        value, outcome = None, (severity, f"{type(err).__name__}: {err}")
    return worst_on_any_rank(group, outcome), value


def _load(
    storage: CheckpointStorage,
    path: str,
    components: TrainingComponents,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[tuple[int, str], tuple[TrainState, dict[str, Any], list[str]] | None]:
    """Read one checkpoint (see the module docstring). Returns the outcome and, when it loaded,
    (train state, the loaded state to apply, warnings)."""

    if not storage.is_remote:  # a remote checkpoint's files are verified as they are fetched
        outcome, _ = _stage(group, UNREADABLE, lambda: verify_checksums(storage.filesystem, path, rank, world_size))
        if outcome[0] != OK:
            return outcome, None
    reader = storage.reader(path)
    outcome, found = _stage(group, UNREADABLE, lambda: read_header(reader, group))
    if outcome[0] != OK:
        return outcome, None
    saved, metadata = found
    state = components.state_to_load(saved, rank, world_size)
    own = state.get(RANK_STATE, {}).get(rank_key(rank), {})
    buffers = f"{RANK_STATE}.{rank_key(rank)}.{BUFFERS}."
    if BUFFERS in own and not any(key.startswith(buffers) for key in metadata.state_dict_metadata):
        del own[BUFFERS]  # written before per-rank buffers were saved: the model entry's are applied

    def check() -> None:
        problems = incompatibilities(metadata, state)
        if problems:
            raise ValueError("; ".join(problems))

    small = {part: value for part, value in state.items() if part not in (MODEL, OPTIMIZER)}
    large = {part: value for part, value in state.items() if part in (MODEL, OPTIMIZER)}
    stages = (
        (INCOMPATIBLE, check),
        (UNREADABLE, lambda: _read(reader, small, group)),
        (INCOMPATIBLE, lambda: components.apply_data_position(small, saved, rank, world_size)),
        (UNREADABLE, lambda: _read(reader, large, group)),
    )
    warnings: list[str] = []
    for severity, fn in stages:
        outcome, value = _stage(group, severity, fn)
        if outcome[0] != OK:
            return outcome, None
        warnings += value if isinstance(value, list) else []
    return outcome, (saved, state, warnings)


def load_newest_loadable(
    storage: CheckpointStorage,
    candidates: list[CheckpointDir],
    components: TrainingComponents,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[CheckpointDir, TrainState] | None:
    """Load the newest candidate that reads on every rank, skipping unreadable ones with a warning.

    Returns None only when there are no candidates. Raises :class:`IncompatibleCheckpointError`
    when a candidate does not fit the job, :class:`NoLoadableCheckpointError` when none reads.
    """
    skipped = []
    for ckpt in candidates:
        started = time.monotonic()
        outcome, loaded = _load(storage, ckpt.path, components, rank, world_size, group)
        if outcome[0] == OK:
            saved, state, warnings = loaded
            outcome, applied = _stage(group, INCOMPATIBLE,
                                      lambda: components.apply_loaded(state, saved, rank, world_size))
        if outcome[0] == INCOMPATIBLE:
            raise IncompatibleCheckpointError(
                f"checkpoint {ckpt.path} (step {ckpt.step}) does not fit this job: {outcome[1]}. The job changed "
                "since it was written (model, optimizer, scheduler, extras or dataset). Every checkpoint of the "
                "run is kept. To train the changed job, start it as a new run (another name or storage path); "
                "to resume this run, restore the job it was written by."
            )
        if outcome[0] == UNREADABLE:
            logger.warning("Checkpoint %s failed to load (%s); falling back to the previous complete checkpoint",
                           ckpt.path, outcome[1])
            skipped.append(f"{ckpt.path}: {outcome[1]}")
            continue
        for warning in warnings + applied:
            logger.warning("Restored %s: %s", ckpt.path, warning)
        logger.log(logging.INFO if rank == 0 else logging.DEBUG, "Restored %s (step %d) in %.3fs", ckpt.path,
                   saved.step, time.monotonic() - started)
        if storage.is_remote:  # every rank has read what it needs: the node keeps this copy only
            keep_only(storage.local_dir, checkpoint_dir_name(ckpt.step, ckpt.attempt))
        return ckpt, saved
    if skipped:
        raise NoLoadableCheckpointError(
            f"none of the run's {len(skipped)} complete checkpoints could be read, so it does not start fresh over "
            "them (they are kept): " + "; ".join(skipped) + ". Fix the storage (or move the damaged checkpoints "
            "away), or start a new run (another name or storage path) to train from scratch."
        )
    return None
