"""The node's copy of a checkpoint on remote storage: what a restore reads, each file fetched once per node.

A restore from remote storage (S3, GCS, ...) does not read shards through small ranged reads of
the remote objects. Each shard file a rank's load plan names is fetched whole into the node's
copy (``<local_dir>/checkpoints/<checkpoint name>/``), several files at once and each in parallel
ranged GETs of ``FETCH_CHUNK_BYTES``, its SHA-256 computed as the bytes arrive and checked against
the checkpoint's manifest (:mod:`~ray_resilient.checkpoint.integrity`) before the file is renamed
into place; DCP then reads the local file. The ranks of a node share the copy (a lock per file),
so each file is fetched once per node whichever of its ranks need it.

Local first: once a checkpoint is durable, the shards this node's ranks wrote for it are moved out
of the upload staging into its copy, so a restart on the same node reads them with no download.
Every file of a copy has its SHA-256 beside it (``<file>.sha256``, computed as its bytes were
written); a kept file is used only when that and its size match the manifest and, hashed again when
a restore takes it (cheap next to a fetch), its bytes do: a file changed on the node's disk is
deleted, with a warning, and fetched again.

Limits: a node keeps the copy of one checkpoint, the newest it saved or restored (its share: the
shards its ranks wrote or read); the others are deleted when a checkpoint is kept, and that one
when the run ends (it finishes, or fails in a way no restart can fix). A file whose
fetch would leave less than ``min_free_bytes`` free on the local disk, or that the disk refuses at
any write (its directories, the lock, the file, its digest: full, over quota, read-only), is not
copied: a warning names the directory, and the file is verified and read straight from remote
storage (streaming, slower) instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from ray_resilient.checkpoint.integrity import (
    ChecksumMismatchError, check_digest, check_listed_size, checksums_file, read_manifest, verify_file,
)
from ray_resilient.checkpoint.layout import parse_checkpoint_dir_name
from ray_resilient.checkpoint.trust import regular_files
from ray_resilient.storage.local_copy import LocalWriteError, copy_to_local, open_local_copy
from ray_resilient.watchdog.progress import note_progress

logger = logging.getLogger(__name__)

NODE_COPIES = "checkpoints"  # under the storage's local_dir
FETCH_CHUNK_BYTES = 8 << 20  # one ranged GET
FETCH_FILES = 4  # files fetched at once
FETCH_GETS = 8  # ranged GETs in flight
FETCH_WINDOW = 4  # a file's chunks fetched ahead of the one being hashed and written
MIN_FREE_BYTES = 1 << 30  # the local disk space a fetch leaves free by default
DIGEST_SUFFIX = ".sha256"


@dataclass
class FetchRecord:
    """What this process fetched from remote storage (``files``: ``<checkpoint>/<file>``), and what it
    read from there instead because the local disk would not take it (``streamed``)."""

    files: list[str] = field(default_factory=list)
    bytes: int = 0
    streamed: list[str] = field(default_factory=list)


def node_copy_dir(local_dir: str, name: str) -> str:
    """The directory of checkpoint ``name``'s copy on this node."""
    return os.path.join(local_dir, NODE_COPIES, name)


def keep_saved(written_dir: str, local_dir: str, name: str, rank: int) -> None:
    """Make the shards this rank wrote for checkpoint ``name`` (now durable) the node's copy of it:
    moved from ``written_dir`` with the checksums it recorded; the node's other copies are deleted."""
    with open(os.path.join(written_dir, checksums_file(rank))) as stream:
        manifest = json.load(stream)
    directory = node_copy_dir(local_dir, name)
    os.makedirs(directory, exist_ok=True)
    for file, entry in manifest.items():
        os.replace(os.path.join(written_dir, file), os.path.join(directory, file))
        _write_digest(os.path.join(directory, file), entry["sha256"])
    keep_only(local_dir, name)


def keep_only(local_dir: str, name: str) -> None:
    """Delete the node's checkpoint copies other than ``name``'s."""
    root = os.path.join(local_dir, NODE_COPIES)
    for other in os.listdir(root) if os.path.isdir(root) else ():
        if other != name and parse_checkpoint_dir_name(other) is not None:
            shutil.rmtree(os.path.join(root, other), ignore_errors=True)


def drop_node_copies(local_dir: str) -> None:
    """Delete every checkpoint copy of the node (the run ended: no restart will read them)."""
    shutil.rmtree(os.path.join(local_dir, NODE_COPIES), ignore_errors=True)


def _ranged_reads(source: pa.NativeFile, size: int, gets: ThreadPoolExecutor) -> Iterator[bytes]:
    """``source``'s ``size`` bytes in order, read in ranges of ``FETCH_CHUNK_BYTES``, up to
    ``FETCH_WINDOW`` of them ahead on ``gets``; none is left running when the caller stops early."""
    offsets = iter(range(0, size, FETCH_CHUNK_BYTES))
    window: deque[Future[bytes]] = deque()

    def more() -> None:
        for offset in offsets:
            window.append(gets.submit(source.read_at, min(FETCH_CHUNK_BYTES, size - offset), offset))
            if len(window) >= FETCH_WINDOW:
                return

    try:
        more()
        while window:
            chunk = window.popleft().result()
            more()
            yield chunk
    finally:
        for pending in window:
            pending.cancel()
        for pending in window:
            if not pending.cancelled():
                pending.exception()


def _hashed(chunks: Iterator[bytes], digest: Any) -> Iterator[bytes]:
    """``chunks``, each added to ``digest`` as it passes."""
    for chunk in chunks:
        digest.update(chunk)
        note_progress()  # a restore fetching files is getting on
        yield chunk


@contextlib.contextmanager
def _local_disk() -> Iterator[None]:
    """Any OSError of the local disk inside becomes a :class:`LocalWriteError`: the file is read from
    remote storage instead."""
    try:
        yield
    except LocalWriteError:
        raise
    except OSError as err:
        raise LocalWriteError(str(err)) from err


def _write_digest(path: str, digest: str) -> None:
    with open(f"{path}{DIGEST_SUFFIX}.tmp", "w") as out:
        out.write(digest)
    os.replace(f"{path}{DIGEST_SUFFIX}.tmp", f"{path}{DIGEST_SUFFIX}")


def _remove_copy(path: str) -> None:
    """Delete a file of a copy and its digest."""
    for stale in (f"{path}{DIGEST_SUFFIX}", path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on ``path`` shared by every process of the node (and every thread)."""
    with _local_disk():
        lock = open(path, "a")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class NodeCopy:
    """The files of the remote checkpoint directory ``remote_dir`` that this process reads, as local
    paths in the node's copy (see the module docstring).

    Args:
        fs, remote_dir: the checkpoint on remote storage.
        local_dir: the storage's node-local directory.
        min_free_bytes: the local disk space a fetch must leave free.
        record: where this process counts what it fetched.
    """

    def __init__(self, fs: pafs.FileSystem, remote_dir: str, local_dir: str, *,
                 min_free_bytes: int = MIN_FREE_BYTES, record: FetchRecord | None = None):
        self.fs, self.remote_dir = fs, remote_dir
        self.name = os.path.basename(remote_dir.rstrip("/"))
        self.directory = node_copy_dir(local_dir, self.name)
        self.min_free_bytes = min_free_bytes
        self.record = record if record is not None else FetchRecord()
        self._listed: dict[str, int] | None = None
        self._manifest: dict[str, dict] = {}
        self._placed: dict[str, str | None] = {}  # file -> local path, or None: read remotely
        self._record_lock = threading.Lock()

    def local_paths(self, names: Iterable[str]) -> dict[str, str]:
        """The local path of each file of ``names``, fetched where the node has no copy of it; a file
        the local disk would not take is verified on remote storage instead and left out."""
        wanted = sorted(set(names) - self._placed.keys())
        if wanted:
            if self._listed is None:
                self._listed = regular_files(self.fs, self.remote_dir)
                self._manifest = read_manifest(self.fs, self.remote_dir, self._listed)
            with ThreadPoolExecutor(FETCH_FILES) as files, ThreadPoolExecutor(FETCH_GETS) as gets:
                self._placed.update(zip(wanted, files.map(lambda name: self._place(name, gets), wanted)))
        return {name: self._placed[name] for name in names if self._placed.get(name) is not None}

    def _place(self, name: str, gets: ThreadPoolExecutor) -> str | None:
        listed = self._listed.get(name)
        expected = self._manifest.get(name) or {"sha256": None, "bytes": listed}
        check_listed_size(name, listed, expected)
        path = os.path.join(self.directory, name)
        try:
            with _local_disk():
                os.makedirs(self.directory, exist_ok=True)
            with _locked(os.path.join(self.directory, f".{name}.lock")):
                if self._has_copy(name, path, expected):
                    return path
                with _local_disk():
                    free = shutil.disk_usage(self.directory).free
                if free - listed < self.min_free_bytes:
                    raise LocalWriteError(f"{free} bytes free, {listed} to fetch and min_free_bytes="
                                          f"{self.min_free_bytes} to leave")
                self._fetch(name, path, expected, gets)
                return path
        except LocalWriteError as err:
            return self._stream_instead(name, expected, listed, str(err))

    def _has_copy(self, name: str, path: str, expected: dict) -> bool:
        """Whether the node keeps ``name`` at ``path`` as the manifest has it: its size and digest file,
        then its bytes, hashed now (a file whose bytes differ is deleted)."""
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) != expected["bytes"]:
            return False
        if expected["sha256"] is None:
            return True
        with _local_disk():
            try:
                with open(f"{path}{DIGEST_SUFFIX}") as stream:
                    if stream.read() != expected["sha256"]:
                        return False
            except FileNotFoundError:
                return False
            try:
                verify_file(pafs.LocalFileSystem(), self.directory, name, expected, expected["bytes"])
            except ChecksumMismatchError as err:
                logger.warning("The node's copy of %s of checkpoint %s (%s) differs from what was written (%s): "
                               "deleting it and fetching it again.", name, self.name, self.directory, err)
                _remove_copy(path)
                return False
        return True

    def _fetch(self, name: str, path: str, expected: dict, gets: ThreadPoolExecutor) -> None:
        """Fetch ``name`` into ``path``, hashed as it arrives; renamed into place only once it matches."""
        size, part = expected["bytes"], f"{path}.part"
        digest = hashlib.sha256()
        try:
            with (self.fs.open_input_file(f"{self.remote_dir}/{name}") as source, open_local_copy(part) as out,
                  contextlib.closing(_ranged_reads(source, size, gets)) as chunks):  # closed first: no read left
                copy_to_local(_hashed(chunks, digest), out)
            with _local_disk():
                size_written = os.path.getsize(part)
            if expected["sha256"] is not None:
                check_digest(name, digest.hexdigest(), size_written, expected)
            with _local_disk():
                os.replace(part, path)
                _write_digest(path, digest.hexdigest())
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(part)
            raise
        with self._record_lock:
            self.record.files.append(f"{self.name}/{name}")
            self.record.bytes += size
        logger.debug("Fetched %s/%s (%d bytes) into %s", self.remote_dir, name, size, self.directory)

    def _stream_instead(self, name: str, expected: dict, listed: int, why: str) -> None:
        """Verify ``name`` on remote storage (streamed once), for DCP to read it from there."""
        logger.warning("Not copying %s of checkpoint %s to local disk (%s: %s): verifying it and reading it "
                       "from remote storage instead, which is slower. Free space in that directory, or give the "
                       "storage another local_dir.", name, self.name, self.directory, why)
        if expected["sha256"] is not None:
            verify_file(self.fs, self.remote_dir, name, expected, listed)
        with self._record_lock:
            self.record.streamed.append(f"{self.name}/{name}")
        return None
