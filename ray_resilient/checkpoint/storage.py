"""The run's checkpoint storage: a pyarrow filesystem plus the experiment directory on it.

Local storage (a disk or a shared mount) is written in place by DCP. Remote storage (S3, GCS,
...) is written through fast local disk: DCP writes the shards locally, each rank uploads its
own files, and ``.metadata`` is uploaded last, once every rank's upload has succeeded.
Reading goes through :class:`ArrowDCPReader`: on local storage straight from the files, on remote
storage from the node's copy of the files a rank's load plan names, each fetched once per node and
verified as it streams (:mod:`~ray_resilient.checkpoint.node_copy`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ray_resilient._torch_internals import read_reader_metadata, redirect_reader
from ray_resilient.checkpoint.layout import METADATA_FILE
from ray_resilient.checkpoint.node_copy import MIN_FREE_BYTES, FetchRecord, NodeCopy
from ray_resilient.checkpoint.safe_loading import read_metadata
from ray_resilient.checkpoint.trust import MAX_METADATA_BYTES, check_size, check_storage_data, regular_files
from ray_resilient.storage.run import RunStorage

MAX_PARALLEL_UPLOADS = 8  # a rank's shard files (one per write thread) upload at once


@dataclass(frozen=True)
class CheckpointStorage(RunStorage):
    """Where one run's checkpoints go: its :class:`~ray_resilient.storage.RunStorage`, with the
    checkpoint directories, local staging, uploads and the node's copies of remote checkpoints on it.

    Args:
        min_free_bytes: the local disk space a restore's fetch into the node's copy leaves free
            (a file that does not fit is read from remote storage instead).
        fetched: what this process fetched from remote storage for restores.
    """

    min_free_bytes: int = MIN_FREE_BYTES
    fetched: FetchRecord = field(default_factory=FetchRecord, compare=False)

    def checkpoint_path(self, name: str) -> str:
        return f"{self.experiment_path}/{name}"

    def write_dir(self, name: str, rank: int) -> str:
        """Where this rank's DCP writer puts the files of checkpoint ``name``."""
        if not self.is_remote:
            return self.checkpoint_path(name)
        return os.path.join(self.local_dir, "staging", name, f"rank_{rank}")

    def clear_local_staging(self) -> None:
        """Remove staged files left on this node by a crashed attempt (call before any save)."""
        shutil.rmtree(os.path.join(self.local_dir, "staging"), ignore_errors=True)

    def upload_shards(self, name: str, rank: int) -> int:
        """Upload this rank's shard files (not ``.metadata``). Returns the bytes uploaded."""
        local = Path(self.write_dir(name, rank))
        remote = self.checkpoint_path(name)
        self.filesystem.create_dir(remote)
        files = [file for file in sorted(local.iterdir()) if file.name != METADATA_FILE]
        with ThreadPoolExecutor(max_workers=max(1, min(len(files), MAX_PARALLEL_UPLOADS))) as pool:
            list(pool.map(lambda file: self._upload_file(file, f"{remote}/{file.name}"), files))
        return sum(file.stat().st_size for file in files)

    def upload_metadata(self, name: str, rank: int) -> None:
        """Upload ``.metadata``, the completeness marker (a single atomic object PUT)."""
        local = Path(self.write_dir(name, rank), METADATA_FILE)
        self._upload_file(local, f"{self.checkpoint_path(name)}/{METADATA_FILE}")

    def _upload_file(self, local: Path, remote: str) -> None:
        pafs.copy_files(
            str(local), remote, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.filesystem
        )

    def reader(self, path: str, fetch: bool = True) -> "ArrowDCPReader":
        """A DCP reader of the checkpoint at ``path``; on remote storage it reads the node's copy
        (fetched as needed) unless ``fetch`` is False (then it streams ranges from remote storage)."""
        copy = None
        if fetch and self.is_remote:
            copy = NodeCopy(self.filesystem, path, self.local_dir, min_free_bytes=self.min_free_bytes,
                            record=self.fetched)
        return ArrowDCPReader(self.filesystem, path, copy)


class _ArrowFileSystem(FileSystemBase):
    """DCP's filesystem interface over a pyarrow filesystem (read side)."""

    def __init__(self, fs: pafs.FileSystem):
        self.fs = fs
        self.local_copies: dict[str, str] = {}  # path -> the local file to read instead

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator:
        if mode != "rb":
            raise ValueError(f"ArrowDCPReader is read-only, got mode {mode!r}")
        local = self.local_copies.get(os.fspath(path))
        with open(local, "rb") if local is not None else self.fs.open_input_file(os.fspath(path)) as stream:
            yield stream

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def init_path(self, path: str | os.PathLike, **kwargs) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.fs.move(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike) -> None:
        self.fs.create_dir(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.fs.get_file_info(os.fspath(path)).type != pafs.FileType.NotFound

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.delete_file(os.fspath(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return [i.path for i in self.fs.get_file_info(pafs.FileSelector(os.fspath(path)))]


class ArrowDCPReader(FileSystemReader):
    """A DCP ``StorageReader`` for a checkpoint directory on any pyarrow filesystem, reading
    ``.metadata`` without running code from it (:mod:`~ray_resilient.checkpoint.safe_loading`)
    and only byte ranges inside the directory's own files (:mod:`~ray_resilient.checkpoint.trust`);
    with a ``node_copy``, the shard files from it."""

    def __init__(self, fs: pafs.FileSystem, path: str, node_copy: NodeCopy | None = None):
        super().__init__(path)
        self._files = _ArrowFileSystem(fs)
        redirect_reader(self, self._files, path)
        self._arrow_fs, self._directory, self._node_copy = fs, path, node_copy

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        files = regular_files(self._arrow_fs, self._directory)
        check_size(self._directory, METADATA_FILE, files.get(METADATA_FILE), MAX_METADATA_BYTES)
        metadata = read_reader_metadata(self, kwargs.get("rank"), read_metadata)
        check_storage_data(self._directory, metadata, files)
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self._node_copy is not None:
            names = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            self._files.local_copies.update({f"{self._directory}/{name}": local
                                             for name, local in self._node_copy.local_paths(names).items()})
        return super().read_data(plan, planner)
