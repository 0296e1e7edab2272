"""A run's storage: the filesystem, the run directory on it, and fast local disk beside it."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.fs as pafs

from ray_resilient._ray_internals import train_run_id, train_run_storage
from ray_resilient.storage.node_local import claim_run_dir, owned_dir
from ray_resilient.storage.uri import open_filesystem


@dataclass(frozen=True)
class RunStorage:
    """Where one run's records go (checkpoints, the goodput ledger, the lease).

    Args:
        filesystem: the storage filesystem (Ray's ``StorageContext.storage_filesystem``).
        experiment_path: the run directory on it (``StorageContext.experiment_fs_path``).
        local_dir: fast local disk for files on their way to or from remote storage (by default a
            directory private to the user under ``$TMPDIR/ray-resilient``, see
            :mod:`~ray_resilient.storage.node_local`).
    """

    filesystem: pafs.FileSystem
    experiment_path: str
    local_dir: str

    @classmethod
    def from_ray_context(cls, local_dir: str | None = None):
        """The storage of the current Ray Train run (call inside a train function): the run
        directory that ``RunConfig(name, storage_path)`` names, on its filesystem."""
        filesystem, experiment_path = train_run_storage()
        # Per Ray Train run, not per run name: runs of the same name (another storage path, or
        # another driver) on this node never share, or clear, each other's local files. Claiming it
        # removes the node's files of runs that are gone.
        return cls(filesystem, experiment_path, local_dir or claim_run_dir(train_run_id()))

    @classmethod
    def from_uri(cls, run_dir: str, local_dir: str | None = None):
        """The storage of the run directory ``run_dir``, a local path or URI (``s3://...``)."""
        filesystem, path = open_filesystem(run_dir)
        return cls(filesystem, path, local_dir or owned_dir("driver"))

    @property
    def is_remote(self) -> bool:
        """True unless the filesystem is the local one (remote writes are staged locally)."""
        return not isinstance(self.filesystem, pafs.LocalFileSystem)
