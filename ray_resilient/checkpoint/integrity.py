"""Checksums of a checkpoint's shard files, recorded when written and verified before a restore.

Each rank writes ``checksums_rank_<r>.json`` (SHA-256 and size of each of its shard files) into
the checkpoint directory after its shards and before ``.metadata`` commits the checkpoint (for
remote storage it is uploaded with the shards). Before any tensor is read, a restore verifies
every file listed, the ranks sharing the files between them (on remote storage, each file a rank
reads as it is fetched into the node's copy, :mod:`~ray_resilient.checkpoint.node_copy`): a flipped
bit or a truncated upload makes the checkpoint unreadable (the restore falls back past it) instead
of silently loaded.
A checkpoint without checksum files (written before they existed) is not verified. What a
manifest names is held to :mod:`~ray_resilient.checkpoint.trust`'s rules; a file whose size
differs from the recorded one fails without being read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import pyarrow.fs as pafs

from ray_resilient.checkpoint.trust import (
    MAX_MANIFEST_BYTES, UntrustedCheckpointError, check_size, checked_file, regular_files,
)
from ray_resilient.watchdog.progress import note_progress

CHECKSUMS_RE = re.compile(r"^checksums_rank_(\d+)\.json$")
CHUNK_BYTES = 8 << 20
VERIFY_THREADS = 8  # files a verification streams at once
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ChecksumMismatchError(OSError):
    """A shard file's content differs from what was written."""


def _sha256(stream: BinaryIO, limit: int | None = None) -> tuple[str, int]:
    """The SHA-256 and size of what ``stream`` holds (read up to ``limit`` bytes plus one)."""
    digest, size = hashlib.sha256(), 0
    while chunk := stream.read(CHUNK_BYTES if limit is None else min(CHUNK_BYTES, limit + 1 - size)):
        digest.update(chunk)
        size += len(chunk)
        note_progress()  # a restore verifying files, or a save hashing them, is getting on
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


def checksums_file(rank: int) -> str:
    """The name of rank ``rank``'s checksum manifest in a checkpoint directory."""
    return f"checksums_rank_{rank}.json"


def record_checksums(directory: str, rank: int, files: list[str], sync: bool) -> None:
    """Write this rank's checksum file for ``files`` (names in the local ``directory``)."""
    manifest = {}
    for name in sorted(set(files)):
        with open(os.path.join(directory, name), "rb") as stream:
            digest, size = _sha256(stream)
        manifest[name] = {"sha256": digest, "bytes": size}
    path = os.path.join(directory, checksums_file(rank))
    with open(f"{path}.tmp", "w") as out:
        json.dump(manifest, out)
        if sync:
            out.flush()
            os.fsync(out.fileno())
    os.replace(f"{path}.tmp", path)


def check_digest(name: str, digest: str, size: int, expected: dict) -> None:
    """:class:`ChecksumMismatchError` unless ``(digest, size)`` of shard ``name`` are the ``expected``
    entry of its manifest."""
    if (digest, size) != (expected["sha256"], expected["bytes"]):
        raise ChecksumMismatchError(
            f"shard {name} fails its checksum ({size} bytes, sha256 {digest[:12]}..., written as "
            f"{expected['bytes']} bytes, sha256 {expected['sha256'][:12]}...): corrupted or truncated"
        )


def check_listed_size(name: str, listed: int | None, expected: dict) -> None:
    """:class:`ChecksumMismatchError` when shard ``name`` is missing or its listed size is not the
    recorded one (checked before any byte of it is read)."""
    if listed is None:
        raise ChecksumMismatchError(f"shard {name} is missing")
    if listed != expected["bytes"]:
        raise ChecksumMismatchError(f"shard {name} fails its checksum ({listed} bytes, written as "
                                    f"{expected['bytes']} bytes): truncated or replaced")


def verify_file(fs: pafs.FileSystem, path: str, name: str, expected: dict, listed: int | None) -> None:
    """Stream shard ``name`` of the checkpoint at ``path`` once, checking it against its ``expected``
    manifest entry (``listed``: its size in the directory listing)."""
    check_listed_size(name, listed, expected)
    try:
        with fs.open_input_stream(f"{path}/{name}") as stream:
            digest, size = _sha256(stream, limit=expected["bytes"])
    except FileNotFoundError as err:
        raise ChecksumMismatchError(f"shard {name} is missing") from err
    check_digest(name, digest, size, expected)


def verify_checksums(fs: pafs.FileSystem, path: str, rank: int, world_size: int) -> int:
    """Verify this rank's share of the checkpoint's recorded files, each streamed once, up to
    ``VERIFY_THREADS`` at a time. Returns how many it checked.

    Raises :class:`ChecksumMismatchError` naming the file when one differs or is missing, and
    :class:`~ray_resilient.checkpoint.trust.UntrustedCheckpointError` for a manifest that names
    what it may not."""
    files = regular_files(fs, path)
    manifest = read_manifest(fs, path, files)
    mine = sorted(manifest)[rank::world_size]
    with ThreadPoolExecutor(max_workers=VERIFY_THREADS) as pool:
        list(pool.map(lambda name: verify_file(fs, path, name, manifest[name], files.get(name)), mine))
    return len(mine)
