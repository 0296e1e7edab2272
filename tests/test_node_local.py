"""The node's default local files (``$TMPDIR/ray-resilient``): private to the user, and the files of runs
gone from the node removed when a run starts."""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ray_resilient.storage.node_local import (
    OWNERS, STALE_AFTER_S, UnsafeLocalDirError, check_owned, claim_run_dir, node_local_dir,
)


@pytest.fixture
def tmpdir_root(tmp_path, monkeypatch) -> Path:
    """``$TMPDIR/ray-resilient`` of a ``$TMPDIR`` of the test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / "ray-resilient"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_root_others_may_write_is_made_private_and_every_directory_under_it_created_private(tmpdir_root):
    tmpdir_root.mkdir()
    tmpdir_root.chmod(0o777)  # as a umask of 0 or another tool would leave it
    run = Path(node_local_dir("run-1"))
    assert run == tmpdir_root / "run-1"
    assert mode(tmpdir_root) == 0o700 and mode(run) == 0o700


def test_a_root_of_another_user_or_not_a_directory_is_refused_naming_it_and_what_to_do(tmpdir_root, tmp_path):
    mine = os.lstat(tmp_path)
    theirs = os.stat_result((mine.st_mode, mine.st_ino, mine.st_dev, mine.st_nlink, os.getuid() + 1, mine.st_gid,
                             mine.st_size, mine.st_atime, mine.st_mtime, mine.st_ctime))
    check_owned(str(tmp_path), mine)
    refusal = f"{re.escape(str(tmp_path))} is owned by another user \\(uid {os.getuid() + 1}\\).*Remove it.*local_dir"
    with pytest.raises(UnsafeLocalDirError, match=refusal):
        check_owned(str(tmp_path), theirs)
    (tmp_path / "elsewhere").mkdir()
    tmpdir_root.symlink_to(tmp_path / "elsewhere")  # another user's link would be refused the same way
    with pytest.raises(UnsafeLocalDirError, match=f"{re.escape(str(tmpdir_root))} is not a directory"):
        node_local_dir("run-1")


def run_dir(root: Path, name: str, owner: int | None, age_s: float) -> Path:
    """A run's directory with files in it, owned by process ``owner`` (None: no owner record), unchanged
    for ``age_s``."""
    path = root / name
    (path / "checkpoints" / "checkpoint_0000000005_000").mkdir(parents=True)
    (path / "checkpoints" / "checkpoint_0000000005_000" / "__0_0.distcp").write_bytes(b"x" * 100)
    if owner is not None:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        (path / OWNERS).write_text(f"{boot} {owner}\n")
    then = time.time() - age_s
    for directory, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            os.utime(os.path.join(directory, name), (then, then))
    os.utime(path, (then, then))
    return path


def test_a_runs_start_removes_the_local_files_of_runs_gone_from_the_node_and_only_those(tmpdir_root, tmp_path, caplog):
    root = Path(node_local_dir())
    exited = subprocess.Popen(["true"])
    exited.wait()
    live = subprocess.Popen(["sleep", "60"])
    old = STALE_AFTER_S + 60
    try:
        crashed = run_dir(root, "crashed", exited.pid, old)
        unowned = run_dir(root, "older-version", None, old)
        recent = run_dir(root, "recent", exited.pid, STALE_AFTER_S / 2)
        running = run_dir(root, "running", live.pid, old)
        cache = run_dir(root, "cache", None, old)
        outside = run_dir(tmp_path, "outside", None, old)
        (root / "a-link").symlink_to(outside)
        with caplog.at_level(logging.INFO):
            current = Path(claim_run_dir("current"))
    finally:
        live.kill()
        live.wait()
    assert not crashed.exists() and not unowned.exists()
    assert f"Removed {crashed}" in caplog.text and f"Removed {unowned}" in caplog.text
    assert recent.is_dir() and running.is_dir() and cache.is_dir() and current.is_dir()
    assert (root / "a-link").is_symlink() and (outside / "checkpoints").is_dir()  # never followed
    claim_run_dir("current")  # a second process of the run, or the same one again
    assert (current / OWNERS).read_text().splitlines() == [
        f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()} {os.getpid()}"]
