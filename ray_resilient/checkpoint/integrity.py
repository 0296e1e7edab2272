"""Checksums of a checkpoint's shard files, recorded when written and verified before a restore.

Each rank writes ``checksums_rank_<r>.json`` (SHA-256 and size of each of its shard files) into
the checkpoint directory after its shards and before ``.metadata`` commits the checkpoint (for
remote storage it is uploaded with the shards). A restore verifies every file listed, the ranks
sharing the files between them, before any tensor is read: a flipped bit or a truncated upload
makes the checkpoint unreadable (the restore falls back past it) instead of silently loaded.
A checkpoint without checksum files (written before they existed) is not verified. What a
manifest names is held to :mod:`~ray_resilient.checkpoint.trust`'s rules; a file whose size
differs from the recorded one fails without being read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import BinaryIO

import pyarrow.fs as pafs

from ray_resilient.checkpoint.trust import (
    MAX_MANIFEST_BYTES, UntrustedCheckpointError, check_size, checked_file, regular_files,
)

CHECKSUMS_RE = re.compile(r"^checksums_rank_(\d+)\.json$")
CHUNK_BYTES = 8 << 20
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ChecksumMismatchError(OSError):
    """A shard file's content differs from what was written."""


def _sha256(stream: BinaryIO, limit: int | None = None) -> tuple[str, int]:
    """The SHA-256 and size of what ``stream`` holds (read up to ``limit`` bytes plus one)."""
    digest, size = hashlib.sha256(), 0
    while chunk := stream.read(CHUNK_BYTES if limit is None else min(CHUNK_BYTES, limit + 1 - size)):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def read_manifest(fs: pafs.FileSystem, path: str, files: dict[str, int]) -> dict[str, dict]:
    """Every rank's recorded {file name: {"sha256", "bytes"}} of the checkpoint at ``path``
    (``files``: its regular files); :class:`UntrustedCheckpointError` for a manifest that breaks a rule."""
    manifest: dict[str, dict] = {}
    for name in sorted(n for n in files if CHECKSUMS_RE.match(n)):
        check_size(path, name, files[name], MAX_MANIFEST_BYTES)
        with fs.open_input_stream(f"{path}/{name}") as stream:
            data = stream.read(MAX_MANIFEST_BYTES + 1)
        try:
            entries = json.loads(data)
        except (UnicodeDecodeError, ValueError) as err:
            raise UntrustedCheckpointError(f"{path}/{name} is not a checksum manifest ({err})") from None
        if not isinstance(entries, dict):
            raise UntrustedCheckpointError(f"{path}/{name} is not a checksum manifest (not an object)")
        for file, expected in entries.items():
            checked_file(path, file, files, name)
            if not (isinstance(expected, dict) and isinstance(expected.get("sha256"), str)
                    and _SHA256_RE.match(expected["sha256"]) and isinstance(expected.get("bytes"), int)
                    and expected["bytes"] >= 0):
                raise UntrustedCheckpointError(f"{path}/{name} records {file} as {expected!r}, not a checksum")
        manifest.update(entries)
    return manifest


def record_checksums(directory: str, rank: int, files: list[str], sync: bool) -> None:
    """Write this rank's checksum file for ``files`` (names in the local ``directory``)."""
    manifest = {}
    for name in sorted(set(files)):
        with open(os.path.join(directory, name), "rb") as stream:
            digest, size = _sha256(stream)
        manifest[name] = {"sha256": digest, "bytes": size}
    path = os.path.join(directory, f"checksums_rank_{rank}.json")
    with open(f"{path}.tmp", "w") as out:
        json.dump(manifest, out)
        if sync:
            out.flush()
            os.fsync(out.fileno())
    os.replace(f"{path}.tmp", path)


def verify_checksums(fs: pafs.FileSystem, path: str, rank: int, world_size: int) -> int:
    """Verify this rank's share of the checkpoint's recorded files. Returns how many it checked.

    Raises :class:`ChecksumMismatchError` naming the file when one differs or is missing, and
    :class:`~ray_resilient.checkpoint.trust.UntrustedCheckpointError` for a manifest that names
    what it may not."""
    files = regular_files(fs, path)
    manifest = read_manifest(fs, path, files)
    mine = sorted(manifest)[rank::world_size]
    for name in mine:
        expected = manifest[name]
        if files[name] != expected["bytes"]:
            raise ChecksumMismatchError(f"shard {name} fails its checksum ({files[name]} bytes, written as "
                                        f"{expected['bytes']} bytes): truncated or replaced")
        try:
            with fs.open_input_stream(f"{path}/{name}") as stream:
                digest, size = _sha256(stream, limit=expected["bytes"])
        except FileNotFoundError as err:
            raise ChecksumMismatchError(f"shard {name} is missing") from err
        if (digest, size) != (expected["sha256"], expected["bytes"]):
            raise ChecksumMismatchError(
                f"shard {name} fails its checksum ({size} bytes, sha256 {digest[:12]}..., written as "
                f"{expected['bytes']} bytes, sha256 {expected['sha256'][:12]}...): corrupted or truncated"
            )
    return len(mine)
