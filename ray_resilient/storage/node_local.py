"""This node's default local files (``$TMPDIR/ray-resilient/``): private to the user, and cleaned up
after runs that are gone.

Every default local directory lies under one root: each run's (its node copies of checkpoints,
upload staging, ledger spools: :meth:`~ray_resilient.storage.RunStorage.from_ray_context`), the
driver's, and the data cache's. The root and each directory under it are created with mode 0700.
One another user owns, or that is not a plain directory (a symlink), is refused: that user could
read or replace every job's local files. One of this user's that others may read or write is made
private again.

A run's directory, and the driver's, records its owners (``.owners``: a line with the boot id and
pid of each process that used it). At a run's start on a node, the other directories under the
root are removed when every owner process is gone and nothing in them changed for
:data:`STALE_AFTER_S` (one without owners, from an older version, is judged on its age alone), so a
crashed driver's files do not stay for ever. The data cache is shared by every run and never
removed as a run's.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import time

logger = logging.getLogger(__name__)

ROOT = "ray-resilient"  # under $TMPDIR
DATA_CACHE = "cache"  # under the root: the data cache of every run
OWNERS = ".owners"  # in a run's directory
STALE_AFTER_S = 6 * 3600.0  # how long another run's directory is left unchanged before its removal
BOOT_ID = "/proc/sys/kernel/random/boot_id"


class UnsafeLocalDirError(PermissionError):
    """The node-local root is not this user's private directory."""


def check_owned(path: str, info: os.stat_result) -> None:
    """:class:`UnsafeLocalDirError` unless ``info`` (``path``'s ``lstat``) is a directory this user owns."""
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a symlink or a file)"
    elif info.st_uid != os.getuid():
        problem = f"is owned by another user (uid {info.st_uid}), who could read or replace this job's local files"
    else:
        return
    raise UnsafeLocalDirError(
        f"{path} {problem}. Remove it, or point TMPDIR at a directory of your own, or give the storage a local_dir "
        "and the dataset a cache_dir of your own.")


def private_dir(path: str) -> str:
    """``path``, a directory created with mode 0700 if missing; refused unless this user owns it
    (:func:`check_owned`), and made private (0700) if others may read or write it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    check_owned(path, info)
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
        logger.info("Made %s private to this user (its mode was %o)", path, stat.S_IMODE(info.st_mode))
    return path


def node_local_dir(*parts: str) -> str:
    """``$TMPDIR/ray-resilient/<parts...>``, each level a :func:`private_dir`."""
    path = private_dir(os.path.join(tempfile.gettempdir(), ROOT))
    for part in parts:
        path = private_dir(os.path.join(path, part))
    return path


def owned_dir(name: str) -> str:
    """The :func:`node_local_dir` ``name`` (a run's, or the driver's), with this process among its owners."""
    path = node_local_dir(name)
    _add_owner(path)
    return path


def claim_run_dir(run_id: str) -> str:
    """This node's directory of run ``run_id`` (an :func:`owned_dir`); the directories of runs gone from
    the node are removed (:func:`remove_stale_runs`)."""
    path = owned_dir(run_id)
    remove_stale_runs(os.path.dirname(path), keep=run_id)
    return path


def remove_stale_runs(root: str, keep: str, now: float | None = None) -> list[str]:
    """Remove the run directories under ``root`` other than ``keep`` whose owners are all gone and that
    nothing changed in for :data:`STALE_AFTER_S`; returns those removed. Symlinks are never followed."""
    now = time.time() if now is None else now
    removed = []
    for entry in os.scandir(root):
        if entry.name in (keep, DATA_CACHE) or not entry.is_dir(follow_symlinks=False):
            continue
        if _owner_alive(entry.path) or now - _last_change(entry.path) <= STALE_AFTER_S:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        logger.info("Removed %s: the local files of a run that is gone from this node (no owner process left, "
                    "unchanged for over %.0f hours)", entry.path, STALE_AFTER_S / 3600)
        removed.append(entry.path)
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this node (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _boot_id() -> str:
    try:
        with open(BOOT_ID) as stream:
            return stream.read().strip()
    except OSError:
        return "unknown"


def _owners(path: str) -> list[tuple[str, int]]:
    """(boot id, pid) of each process recorded as an owner of ``path`` (none without a record)."""
    try:
        with open(os.path.join(path, OWNERS)) as stream:
            lines = stream.read().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return []
    owners = []
    for line in lines:
        boot, _, pid = line.partition(" ")
        if pid.isdigit():
            owners.append((boot, int(pid)))
    return owners


def _add_owner(path: str) -> None:
    """Record this process as an owner of ``path`` (once; appended whole, so processes may add at once)."""
    me = (_boot_id(), os.getpid())
    if me not in _owners(path):
        fd = os.open(os.path.join(path, OWNERS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{me[0]} {me[1]}\n".encode())
        finally:
            os.close(fd)


def _owner_alive(path: str) -> bool:
    boot = _boot_id()
    return any(owner_boot == boot and process_alive(pid) for owner_boot, pid in _owners(path))


def _last_change(path: str) -> float:
    """The newest modification time of ``path`` and everything in it (symlinks not followed)."""
    newest = 0.0
    for directory, dirnames, filenames in os.walk(path):
        for name in (".", *dirnames, *filenames):
            try:
                newest = max(newest, os.lstat(os.path.join(directory, name)).st_mtime)
            except FileNotFoundError:
                pass
    return newest
