"""Where a run stands: its checkpoints, its attempts, its goodput so far, what a restart would do.

Read from the run directory alone (any storage URI), without Ray: ``ray-resilient status RUN_DIR``.
A checkpoint *verifies* when a restore would read it: its shards match their checksums and its
``.metadata`` and train state pass the restore's checks (:mod:`~ray_resilient.checkpoint.trust`).
By default only what a restart would try is verified: the newest complete checkpoint, and older
ones only while the newer do not verify (``verify="all"`` checks every one, in parallel).
Sizes never follow a symlink (a link to ``/`` would never return), and a ``checkpoint_*`` entry that
is a symlink is skipped, saying so.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import pyarrow.fs as pafs

from ray_resilient.checkpoint.integrity import VERIFY_THREADS, verify_checksums
from ray_resilient.checkpoint.layout import CheckpointDir, list_checkpoints, parse_checkpoint_dir_name
from ray_resilient.checkpoint.lease import LEASE_DIR
from ray_resilient.checkpoint.restore import read_header
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.goodput.accounting import AttemptSummary
from ray_resilient.goodput.ledger import LEDGER_DIR, read_ledger

Verify = Literal["none", "newest", "all"]


@dataclass(frozen=True)
class CheckpointStatus:
    step: int
    attempt: int
    path: str
    complete: bool  # its .metadata is written: every shard was durable
    bytes: int
    registered: bool  # Ray Train was told of it (the ledger's "registered" event)
    verifies: bool | None  # a restore would read it (None: partial, or not checked)
    problem: str | None  # why it does not verify


@dataclass(frozen=True)
class AttemptStatus:
    started: float  # wall-clock time (s since the epoch)
    world_size: int | None
    restored_step: int | None  # None: it died before restoring
    last_step: int | None
    ended: str  # "finished", "failed: <error>", or "running or killed" (no end recorded)


@dataclass(frozen=True)
class RunStatus:
    run_dir: str
    checkpoints: list[CheckpointStatus]
    attempts: list[AttemptStatus]
    goodput: float | None  # None: the run has no ledger yet
    restart_would_load: str | None  # the newest complete checkpoint that verifies (unverified: the newest)
    restart_would_refuse: bool  # complete checkpoints exist and none verifies: NoLoadableCheckpointError
    skipped: list[str]  # checkpoint_* entries that are symlinks: neither sized, verified nor listed


def _is_link(fs: pafs.FileSystem, path: str) -> bool:
    """Whether ``path`` is a symlink (on local disk: object stores have none)."""
    return isinstance(fs, pafs.LocalFileSystem) and os.path.islink(path)


def _size(fs: pafs.FileSystem, path: str) -> int:
    """The bytes of the files under directory ``path``, symlinks not followed (nor counted)."""
    total = 0
    for info in fs.get_file_info(pafs.FileSelector(path)):
        if _is_link(fs, info.path):
            continue
        if info.type == pafs.FileType.File:
            total += info.size or 0
        elif info.type == pafs.FileType.Directory:
            total += _size(fs, info.path)
    return total


def _verify(storage: CheckpointStorage, checkpoint: CheckpointDir) -> tuple[bool, str | None]:
    """Whether a restore would read ``checkpoint`` (complete), and why not."""
    try:
        verify_checksums(storage.filesystem, checkpoint.path, rank=0, world_size=1)  # one reader: every shard
        read_header(storage.reader(checkpoint.path, fetch=False))  # verified just now: no copy
    except BaseException as error:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        return False, str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
    return True, None


def _verified(storage: CheckpointStorage, checkpoints: list[CheckpointDir],
              verify: Verify) -> dict[str, tuple[bool, str | None]]:
    """Checkpoint path -> (verifies, problem) for the complete checkpoints ``verify`` checks."""
    complete = [c for c in checkpoints if c.complete]
    if verify == "all":
        with ThreadPoolExecutor(max_workers=VERIFY_THREADS) as pool:
            return dict(zip((c.path for c in complete), pool.map(lambda c: _verify(storage, c), complete)))
    found = {}
    if verify == "newest":
        for checkpoint in reversed(complete):  # as a restart tries them
            found[checkpoint.path] = _verify(storage, checkpoint)
            if found[checkpoint.path][0]:
                break
    return found


def _require_run_directory(fs: pafs.FileSystem, path: str, run_dir: str) -> None:
    """ValueError unless ``path`` is a run directory (checkpoints, a ledger or a lease in it)."""
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise ValueError(f"{run_dir} is not a directory: pass <storage_path>/<run name> of a run")
    entries = fs.get_file_info(pafs.FileSelector(path))
    names = {info.base_name for info in entries}
    if names & {LEDGER_DIR, LEASE_DIR} or any(parse_checkpoint_dir_name(name) for name in names):
        return
    if parse_checkpoint_dir_name(path.rstrip("/").rsplit("/", 1)[-1]):
        raise ValueError(f"{run_dir} is a checkpoint, not a run directory: pass its parent, "
                         f"{run_dir.rstrip('/').rsplit('/', 1)[0]}")
    runs = sorted(info.base_name for info in entries if info.type == pafs.FileType.Directory)
    raise ValueError(f"{run_dir} is not a run directory (no checkpoints, goodput ledger or lease in it)"
                     + (f"; it holds {', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''}: pass one of them"
                        if runs else "") + ": pass <storage_path>/<run name> of a run")


def _attempt(attempt: AttemptSummary, failures: list[tuple[float, str]], next_start: float) -> AttemptStatus:
    """``failures``: (time, error) recorded by any rank; the attempt's are those before ``next_start``."""
    if attempt.finished:
        ended = "finished"
    else:
        error = next((message for t, message in failures if attempt.start <= t < next_start), None)
        ended = f"failed: {error}" if error else "running or killed (no end recorded)"
    return AttemptStatus(attempt.start, attempt.world_size, attempt.restored_step, attempt.last_step, ended)


def run_status(run_dir: str, verify: Verify = "newest") -> RunStatus:
    """The status of the run directory ``run_dir`` (a local path or a URI such as
    ``s3://bucket/runs/name``), verifying the checkpoints ``verify`` says (see the module docstring)."""
    storage = CheckpointStorage.from_uri(run_dir)
    fs, path = storage.filesystem, storage.experiment_path
    _require_run_directory(fs, path, run_dir)
    ledger = read_ledger(fs, path)
    registered = {step for attempt in ledger.attempts for step in attempt.registered}
    listed = list_checkpoints(fs, path)
    found = [c for c in listed if not _is_link(fs, c.path)]
    verified = _verified(storage, found, verify)
    checkpoints = []
    for checkpoint in found:
        verifies, problem = verified.get(checkpoint.path, (None, None if checkpoint.complete else
                                                           "partial: no .metadata (its save never finished)"))
        checkpoints.append(CheckpointStatus(checkpoint.step, checkpoint.attempt, checkpoint.path, checkpoint.complete,
                                            _size(fs, checkpoint.path), checkpoint.step in registered, verifies,
                                            problem))
    attempts = ledger.attempts
    next_starts = [a.start for a in attempts[1:]] + [float("inf")]
    complete = [c for c in checkpoints if c.complete]
    loadable = [c for c in complete if c.verifies is not False]  # unverified ones are taken as they are
    return RunStatus(
        run_dir=run_dir,
        checkpoints=checkpoints,
        attempts=[_attempt(a, ledger.failures, next_start) for a, next_start in zip(attempts, next_starts)],
        goodput=ledger.account().goodput if attempts else None,
        restart_would_load=loadable[-1].path if loadable else None,
        restart_would_refuse=bool(complete) and not loadable,
        skipped=[c.path for c in listed if _is_link(fs, c.path)],
    )


def _format_bytes(size: int) -> str:
    value, unit = float(size), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"


def format_status(status: RunStatus) -> str:
    """The status as a human-readable report."""
    lines = [f"Run {status.run_dir}", "", "Checkpoints (oldest first)"]
    for c in status.checkpoints:
        state = "complete" if c.complete else "partial"
        check = {True: "verifies", False: f"does NOT verify: {c.problem}", None: "not checked"}[c.verifies]
        lines.append(f"  step {c.step:>7}  attempt {c.attempt}  {state:8}  {_format_bytes(c.bytes):>9}  "
                     f"{'registered' if c.registered else 'not registered'}  {check}")
    if not status.checkpoints:
        lines.append("  none")
    lines += [f"  skipped {path}: a symlink, not a checkpoint directory" for path in status.skipped]
    lines += ["", "Attempts"]
    for number, a in enumerate(status.attempts, 1):
        restored = "died before restoring" if a.restored_step is None else f"from step {a.restored_step}"
        workers = "? workers" if a.world_size is None else f"{a.world_size} worker{'s' * (a.world_size != 1)}"
        lines.append(f"  {number}. {workers}, {restored}, last step {a.last_step}: {a.ended}")
    if not status.attempts:
        lines.append("  none recorded (no goodput ledger)")
    lines += ["", f"Goodput so far: {'unknown' if status.goodput is None else f'{status.goodput:.1%}'}",
              f"A restart would {_restart(status)}"]
    return "\n".join(lines)


def _restart(status: RunStatus) -> str:
    if status.restart_would_refuse:
        return ("refuse to start (NoLoadableCheckpointError): no complete checkpoint verifies, and a run never "
                "starts fresh over its checkpoints")
    return f"load: {status.restart_would_load or 'nothing (it would start fresh)'}"
