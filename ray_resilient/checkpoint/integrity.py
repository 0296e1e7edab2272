"""Checksums of a checkpoint's shard files, recorded when written and verified before a restore.

Each rank writes ``checksums_rank_<r>.json`` (SHA-256 and size of each of its shard files) into
the checkpoint directory after its shards and before ``.metadata`` commits the checkpoint (for
remote storage it is uploaded with the shards). A restore verifies every file listed, the ranks
sharing the files between them, before any tensor is read: a flipped bit or a truncated upload
makes the checkpoint unreadable (the restore falls back past it) instead of silently loaded.
A checkpoint without checksum files (written before they existed) is not verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import BinaryIO

import pyarrow.fs as pafs

CHECKSUMS_RE = re.compile(r"^checksums_rank_(\d+)\.json$")
CHUNK_BYTES = 8 << 20


class ChecksumMismatchError(OSError):
    """A shard file's content differs from what was written."""


def _sha256(stream: BinaryIO) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := stream.read(CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


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

    Raises :class:`ChecksumMismatchError` naming the file when one differs or is missing."""
    manifest: dict[str, dict] = {}
    for info in fs.get_file_info(pafs.FileSelector(path)):
        if CHECKSUMS_RE.match(info.base_name):
            with fs.open_input_stream(info.path) as stream:
                manifest.update(json.loads(stream.read()))
    mine = sorted(manifest)[rank::world_size]
    for name in mine:
        expected = manifest[name]
        try:
            with fs.open_input_stream(f"{path}/{name}") as stream:
                digest, size = _sha256(stream)
        except FileNotFoundError as err:
            raise ChecksumMismatchError(f"shard {name} is missing") from err
        if (digest, size) != (expected["sha256"], expected["bytes"]):
            raise ChecksumMismatchError(
                f"shard {name} fails its checksum ({size} bytes, sha256 {digest[:12]}..., written as "
                f"{expected['bytes']} bytes, sha256 {expected['sha256'][:12]}...): corrupted or truncated"
            )
    return len(mine)
