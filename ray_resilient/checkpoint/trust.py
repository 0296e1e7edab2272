"""What a restore accepts from a checkpoint directory: write access to a run directory must not
reach beyond it.

Names read from a checkpoint (shard files in ``.metadata``, entries of checksum manifests) must be
bare names of regular files in the checkpoint's own directory: no ``/``, no ``..``, no symlink
(on local disk), no device file. Every byte range ``.metadata`` names lies inside its file, and
no transform is applied that this project does not write. Sizes and counts are bounded before
anything is allocated for them. A checkpoint that breaks a rule is unreadable (a restore falls
back to the previous one) with an :class:`UntrustedCheckpointError` naming the file and the rule.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pyarrow.fs as pafs

MAX_MANIFEST_BYTES = 16 << 20  # a checksum manifest (one entry per shard file of a rank)
MAX_METADATA_BYTES = 1 << 30  # a .metadata file
MAX_WORLD_SIZE = 1 << 16  # the world size a checkpoint says it was written by
_BARE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


class UntrustedCheckpointError(OSError):
    """A checkpoint file breaks a rule of what a restore accepts (see the module docstring)."""


def regular_files(fs: pafs.FileSystem, directory: str) -> dict[str, int]:
    """Name -> size of the regular files directly in ``directory`` (on local disk, not symlinks)."""
    local = isinstance(fs, pafs.LocalFileSystem)
    return {info.base_name: info.size for info in fs.get_file_info(pafs.FileSelector(directory))
            if info.type == pafs.FileType.File and not (local and os.path.islink(info.path))}


def checked_file(directory: str, name: Any, files: dict[str, int], source: str) -> int:
    """The size of file ``name`` that ``source`` names; :class:`UntrustedCheckpointError` unless it
    is a bare name of a regular file in ``directory`` (``files``: :func:`regular_files`)."""
    if not isinstance(name, str) or not _BARE_NAME.match(name) or name in (".", ".."):
        raise UntrustedCheckpointError(f"{directory}/{source} names {name!r}: only a bare file name of the "
                                       "checkpoint's own directory is accepted (no path, no '..')")
    if name not in files:
        raise UntrustedCheckpointError(f"{directory}/{source} names {name!r}, which is not a regular file of "
                                       "the checkpoint's directory (missing, a symlink or a device)")
    return files[name]


def check_size(directory: str, name: str, size: int | None, limit: int) -> None:
    """:class:`UntrustedCheckpointError` when file ``name`` is larger than ``limit`` bytes."""
    if size is not None and size > limit:
        raise UntrustedCheckpointError(f"{directory}/{name} is {size} bytes, more than the {limit} accepted")


def check_storage_data(directory: str, metadata: Any, files: dict[str, int]) -> None:
    """Every byte range of DCP ``metadata`` lies inside a regular file of ``directory``, untransformed."""
    for index, info in metadata.storage_data.items():
        size = checked_file(directory, getattr(info, "relative_path", None), files, ".metadata")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= size):
            raise UntrustedCheckpointError(
                f"{directory}/.metadata places {getattr(index, 'fqn', index)!r} at bytes {offset!r}+{length!r} "
                f"of {info.relative_path} ({size} bytes): outside the file")
        if getattr(info, "transform_descriptors", None):
            raise UntrustedCheckpointError(
                f"{directory}/.metadata asks for transforms {info.transform_descriptors!r} on {info.relative_path}: "
                "this project writes none")


def check_world_size(directory: str, world_size: Any) -> None:
    """:class:`UntrustedCheckpointError` unless the saved world size is a sane count of ranks."""
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UntrustedCheckpointError(f"{directory} says it was written by {world_size!r} ranks: at most "
                                       f"{MAX_WORLD_SIZE} are accepted")
