"""Where a run stands: its checkpoints, its attempts, its goodput so far, what a restart would load.

Read from the run directory alone (any storage URI), without Ray: ``ray-resilient status RUN_DIR``.
"""

from __future__ import annotations

from dataclasses import dataclass
import pyarrow.fs as pafs

from ray_resilient.checkpoint.integrity import ChecksumMismatchError, verify_checksums
from ray_resilient.checkpoint.layout import CheckpointDir, list_checkpoints
from ray_resilient.goodput.accounting import Attempt, account, group_attempts
from ray_resilient.goodput.events import EventKind
from ray_resilient.goodput.ledger import read_events
from ray_resilient.storage.run import RunStorage


@dataclass(frozen=True)
class CheckpointStatus:
    step: int
    attempt: int
    path: str
    complete: bool  # its .metadata is written: every shard was durable
    bytes: int
    registered: bool  # Ray Train was told of it (the ledger's "registered" event)
    verifies: bool | None  # every shard matches its recorded checksum (None: partial, not checked)
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
    restart_would_load: str | None  # the newest complete checkpoint that verifies


def _size(fs: pafs.FileSystem, path: str) -> int:
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return sum(info.size or 0 for info in infos if info.type == pafs.FileType.File)


def _verify(fs: pafs.FileSystem, checkpoint: CheckpointDir) -> tuple[bool | None, str | None]:
    if not checkpoint.complete:
        return None, "partial: no .metadata (its save never finished)"
    try:
        verify_checksums(fs, checkpoint.path, rank=0, world_size=1)  # one reader checks every shard
    except (ChecksumMismatchError, OSError) as error:
        return False, str(error)
    return True, None


def _attempt(attempt: Attempt, failures: list[tuple[float, str]], next_start: float) -> AttemptStatus:
    """``failures``: (time, error) recorded by any rank; the attempt's are those before ``next_start``."""
    start = next((e for e in attempt.events if e["kind"] == EventKind.ATTEMPT_START), None)
    steps = [e["step"] for e in attempt.events if e["kind"] == EventKind.STEP]
    if attempt.finished:
        ended = "finished"
    else:
        error = next((message for t, message in failures if attempt.start <= t < next_start), None)
        ended = f"failed: {error}" if error else "running or killed (no end recorded)"
    return AttemptStatus(attempt.start, start.get("world_size") if start else None, attempt.restored_step,
                         max(steps, default=None), ended)


def run_status(run_dir: str) -> RunStatus:
    """The status of the run directory ``run_dir`` (a local path or a URI such as ``s3://bucket/runs/name``)."""
    storage = RunStorage.from_uri(run_dir)
    fs, path = storage.filesystem, storage.experiment_path
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise ValueError(f"{run_dir} is not a directory: pass <storage_path>/<run name> of a run")
    events = read_events(fs, path)
    registered = {e["step"] for e in events if e["kind"] == EventKind.REGISTERED}
    checkpoints = []
    for checkpoint in list_checkpoints(fs, path):
        verifies, problem = _verify(fs, checkpoint)
        checkpoints.append(CheckpointStatus(checkpoint.step, checkpoint.attempt, checkpoint.path, checkpoint.complete,
                                            _size(fs, checkpoint.path), checkpoint.step in registered, verifies,
                                            problem))
    attempts, _ = group_attempts(events)
    failures = sorted((e["t"], e.get("error", "")) for e in events if e["kind"] == EventKind.FAILURE)
    next_starts = [a.start for a in attempts[1:]] + [float("inf")]
    loadable = [c for c in checkpoints if c.verifies]
    return RunStatus(
        run_dir=run_dir,
        checkpoints=checkpoints,
        attempts=[_attempt(a, failures, next_start) for a, next_start in zip(attempts, next_starts)],
        goodput=account(events).goodput if attempts else None,
        restart_would_load=loadable[-1].path if loadable else None,
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
    lines += ["", "Attempts"]
    for number, a in enumerate(status.attempts, 1):
        restored = "died before restoring" if a.restored_step is None else f"from step {a.restored_step}"
        workers = "? workers" if a.world_size is None else f"{a.world_size} worker{'s' * (a.world_size != 1)}"
        lines.append(f"  {number}. {workers}, {restored}, last step {a.last_step}: {a.ended}")
    if not status.attempts:
        lines.append("  none recorded (no goodput ledger)")
    lines += ["", f"Goodput so far: {'unknown' if status.goodput is None else f'{status.goodput:.1%}'}",
              f"A restart would load: {status.restart_would_load or 'nothing (it would start fresh)'}"]
    return "\n".join(lines)
