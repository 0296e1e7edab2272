"""A dataset root on any pyarrow filesystem: a local path or mount, s3://, gs://, or an fsspec URL."""

from __future__ import annotations

import fnmatch
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import pyarrow.fs as pafs
import urllib3

from ray_resilient.data.s3_get import SignedGetReader
from ray_resilient.storage.local_copy import LocalWriteError, copy_to_local, open_local_copy
from ray_resilient.storage.s3_requests import S3RequestError
from ray_resilient.storage.uri import open_filesystem, s3_settings

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
MAX_BACKOFF_S = 2.0  # the longest wait between two reads of a file (before jitter)


class VolumeError(RuntimeError):
    """The volume is missing, empty, or a file on it cannot be read."""


@dataclass(frozen=True)
class VolumeFile:
    """One file of the volume: its path relative to the root, size and (ImageFolder) label."""

    path: str
    size: int
    label: int = -1


class Volume:
    """The files under a root, listed deterministically, read with retries.

    Args:
        uri: the dataset root (a path, ``s3://bucket/prefix``, ``gs://...``, an fsspec URL).
        extensions: keep files ending with one of these (case-insensitive); None keeps all.
        pattern: an optional glob the relative path must match (e.g. ``"train/*/*.jpg"``).
        image_folder: labels from the first directory under the root (``root/<class>/<file>``).
        retry_seconds: how long a read keeps retrying transient storage errors (connection
            failures, throttling such as S3's 503 SlowDown, server errors), with exponential
            backoff and jitter, before it fails naming the file.
        filesystem: use this filesystem with ``uri`` as the path on it (e.g. a configured
            ``S3FileSystem``); else it is derived from ``uri`` (see :func:`open_filesystem`).

    Files of an ``s3://`` volume opened from its URI are downloaded with one signed GET each
    (:mod:`ray_resilient.data.s3_get`); everything else, listing included, goes through pyarrow.
    """

    def __init__(
        self,
        uri: str,
        *,
        extensions: tuple[str, ...] | None = IMAGE_EXTENSIONS,
        pattern: str | None = None,
        image_folder: bool = True,
        retry_seconds: float = 30.0,
        filesystem: pafs.FileSystem | None = None,
        **filesystem_options: str,
    ):
        self.uri = uri
        self._signed_get: SignedGetReader | None = None
        if filesystem is None:
            self.filesystem, self.root = open_filesystem(uri, **filesystem_options)
            if urlparse(uri).scheme == "s3":
                self._signed_get = SignedGetReader(*s3_settings(**filesystem_options))
        else:
            self.filesystem, self.root = filesystem, uri.rstrip("/")
        self.retry_seconds = retry_seconds
        self.files, self.classes = self._list(extensions, pattern, image_folder)

    def _list(
        self, extensions: tuple[str, ...] | None, pattern: str | None, image_folder: bool
    ) -> tuple[list[VolumeFile], list[str]]:
        info = self.filesystem.get_file_info(self.root)
        if info.type != pafs.FileType.Directory:
            raise VolumeError(f"volume {self.uri} does not exist or is not a directory")
        selector = pafs.FileSelector(self.root, recursive=True)
        entries = []
        for item in self.filesystem.get_file_info(selector):
            if item.type != pafs.FileType.File:
                continue
            rel = item.path[len(self.root):].lstrip("/")
            if extensions is not None and not rel.lower().endswith(tuple(e.lower() for e in extensions)):
                continue
            if pattern is not None and not fnmatch.fnmatch(rel, pattern):
                continue
            entries.append((rel, item.size))
        entries.sort()
        if not entries:
            wanted = f" matching {extensions or ''} {pattern or ''}".rstrip()
            raise VolumeError(f"volume {self.uri} has no files{wanted}")
        if not image_folder:
            return [VolumeFile(p, s) for p, s in entries], []
        if any("/" not in p for p, _ in entries):
            loose = next(p for p, _ in entries if "/" not in p)
            raise VolumeError(
                f"volume {self.uri} is not an ImageFolder layout (root/<class>/<file>): {loose} is not in a "
                "class directory; pass image_folder=False for unlabeled files"
            )
        classes = sorted({p.split("/", 1)[0] for p, _ in entries})
        index = {name: i for i, name in enumerate(classes)}
        return [VolumeFile(p, s, index[p.split("/", 1)[0]]) for p, s in entries], classes

    @property
    def num_classes(self) -> int:
        """The number of ImageFolder classes (0 without labels).

        Use it in train functions defined in ``__main__``: cloudpickle mistakes any ``.classes``
        attribute there for the ``torch.classes`` module and fails to pickle the function.
        """
        return len(self.classes)

    @property
    def is_remote(self) -> bool:
        return not isinstance(self.filesystem, pafs.LocalFileSystem)

    def listing(self) -> list[tuple[str, int]]:
        """(relative path, size) of every file, in order: what the plan fingerprint covers."""
        return [(f.path, f.size) for f in self.files]

    def download(self, path: str, dest: str, on_retry: Callable[[], None] | None = None) -> int:
        """Stream the file at ``path`` (relative) into the local file ``dest``; returns its size.

        Transient storage errors are retried for ``retry_seconds`` with exponential backoff and
        jitter (``on_retry`` called at each), then raise VolumeError naming the file; an error that
        retrying cannot fix (a missing file, no permission, S3's 403 or 404) raises at once, and so
        does an error writing ``dest`` (a full or read-only local disk is not a storage error).
        """
        full = f"{self.root}/{path}"
        started, attempt = time.monotonic(), 1
        while True:
            try:
                if self._signed_get is not None:
                    return self._signed_get.download(full, dest)
                with self.filesystem.open_input_stream(full) as src, open_local_copy(dest) as dst:
                    copy_to_local(src, dst)
                    return dst.tell()
            except LocalWriteError as err:
                raise VolumeError(f"writing the local copy of {self.uri}/{path} failed: {err.__cause__} "
                                  "(the cache's disk, not the volume: free space or fix its permissions)") from err
            except (OSError, urllib3.exceptions.HTTPError) as err:
                if isinstance(err, (FileNotFoundError, PermissionError)) or (
                        isinstance(err, S3RequestError) and not err.retryable):
                    raise VolumeError(f"reading {self.uri}/{path} failed: {err}") from err
                elapsed = time.monotonic() - started
                if elapsed >= self.retry_seconds:
                    raise VolumeError(
                        f"reading {full} failed after {attempt} attempts in {elapsed:.1f}s: {err}") from err
                backoff = random.uniform(0.5, 1.0) * min(MAX_BACKOFF_S, 0.1 * 2**attempt)
                delay = min(self.retry_seconds - elapsed, backoff)
                logger.warning("reading %s failed (%s); retrying in %.2fs", full, err, delay)
                if on_retry is not None:
                    on_retry()
                time.sleep(delay)
                attempt += 1
