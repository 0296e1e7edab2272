"""Where checkpoints live in a run's storage, and which of them are complete.

A checkpoint is the directory ``<experiment>/checkpoint_<step>_<attempt>`` holding standard DCP
files. ``attempt`` is the run lease's generation its writer holds (:mod:`~ray_resilient.checkpoint.lease`:
a new one at every restore), so a step recomputed after a failure is saved under a new name and
two writers never share one: an existing directory (which Ray may have registered) is never overwritten.
DCP writes ``.metadata`` only after every rank's shard is durable (and for remote storage we
upload it last), so its presence is the completeness marker: a directory without it is a
save that was interrupted and must never be loaded.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

logger = logging.getLogger(__name__)

METADATA_FILE = ".metadata"
_NAME_RE = re.compile(r"^checkpoint_(\d{10})_(\d{3,})$")


def checkpoint_dir_name(step: int, attempt: int) -> str:
    """The directory name of the checkpoint taken after ``step`` steps by ``attempt``."""
    return f"checkpoint_{step:010d}_{attempt:03d}"


def parse_checkpoint_dir_name(name: str) -> tuple[int, int] | None:
    """(step, attempt) of a checkpoint directory name, or None for other names."""
    match = _NAME_RE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True, order=True)
class CheckpointDir:
    """One checkpoint directory on the run's storage filesystem; orders oldest to newest."""

    step: int
    attempt: int
    path: str
    complete: bool


def is_complete(fs: pafs.FileSystem, path: str) -> bool:
    """Whether the checkpoint at ``path`` has its ``.metadata`` (i.e. every shard is durable)."""
    info = fs.get_file_info(f"{path}/{METADATA_FILE}")
    return info.type == pafs.FileType.File


class CheckpointExistsError(FileExistsError):
    """A save was about to write into the directory of a complete checkpoint."""


def refuse_complete(fs: pafs.FileSystem, path: str) -> None:
    """Raise :class:`CheckpointExistsError` when ``path`` is a complete checkpoint: no writer ever
    writes into one (what it would replace may be registered with Ray, or restored from)."""
    if is_complete(fs, path):
        raise CheckpointExistsError(
            f"refusing to write into {path}: it holds a complete checkpoint, which is never written over "
            "(two writers of one run, or a reused attempt number)")


def list_checkpoints(fs: pafs.FileSystem, experiment_path: str) -> list[CheckpointDir]:
    """All checkpoint directories of a run, oldest first, each marked complete or not."""
    selector = pafs.FileSelector(experiment_path, allow_not_found=True)
    found = []
    for info in fs.get_file_info(selector):
        parsed = parse_checkpoint_dir_name(info.base_name)
        if parsed is None or info.type != pafs.FileType.Directory:
            continue
        found.append(CheckpointDir(*parsed, info.path, is_complete(fs, info.path)))
    return sorted(found)


def delete_partial_checkpoints(fs: pafs.FileSystem, experiment_path: str) -> list[str]:
    """Delete the partial directories older than the newest complete checkpoint.

    Partial directories newer than it are left alone (they may belong to a save in flight);
    complete checkpoints are never touched here: retention is Ray's ``num_to_keep``.
    Returns the deleted paths.
    """
    checkpoints = list_checkpoints(fs, experiment_path)
    complete = [c for c in checkpoints if c.complete]
    if not complete:
        return []
    newest = complete[-1]
    deleted = []
    for ckpt in checkpoints:
        if not ckpt.complete and ckpt < newest:
            fs.delete_dir(ckpt.path)
            deleted.append(ckpt.path)
            logger.info("Deleted partial checkpoint %s (older than complete %s)", ckpt.path, newest.path)
    return deleted
