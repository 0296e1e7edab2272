"""What a run prints on its driver's console: the run's story, not Ray's bookkeeping.

By default (``recommended_ray_config(verbose=False)``) the console shows the train function's
own output (rank 0's progress lines), one line per checkpoint made durable, and for each failure
one short block: what failed (:class:`ReportFailures`: the rank, its host and process, how),
then, from the restarted attempt's rank 0, what the failures cost so far and where the run
resumes. Quietened, never lost (Ray's log files keep every line): Ray Train's informational logs
(a line per report, process-group setup, placement), the output of the raylet and of Ray Train's
own actors (the controller's error blocks with tracebacks, printed again at each retry; the
placement-group cleaner's), and other ranks' repeats of rank 0's lines. ``verbose=True`` brings all of it back.
"""

from __future__ import annotations

import re
from typing import Any

from ray.train import UserCallback

FAILURE_MARK = "[failure]"  # starts the lines of the failure block (the only controller lines shown)
_HOST = re.compile(r"hostname='([^']*)'")
_PID = re.compile(r"\bpid=(\d+)")
_EXIT_TYPE = re.compile(r"Worker exit type: (\w+)")
# Ray Train's own actors besides the workers (Ray 2.60's class names): their output is Ray's bookkeeping.
RAY_TRAIN_ACTORS = frozenset({"TrainController", "PlacementGroupCleaner", "PreemptionWatcher", "SynchronizationActor",
                              "DatasetManager"})
# Ray Train's line per report, logged on a worker by a logger its log level does not reach (Ray 2.60
# names it after the module's file, outside ``ray.train``).
RAY_TRAIN_REPORT_LINE = "Reporting training result "


def shown_lines(batch: dict[str, Any]) -> list[str]:
    """The lines of a batch of worker output the console shows (see the module docstring): none of
    the raylet's or Ray Train's own actors' but the failure block, no worker's line per report."""
    if batch.get("pid") == "raylet":
        return []
    if batch.get("actor_name") in RAY_TRAIN_ACTORS:
        return [line for line in batch["lines"] if line.startswith(FAILURE_MARK)]
    return [line for line in batch["lines"] if line.strip() and not line.startswith(RAY_TRAIN_REPORT_LINE)]


class ReportFailures(UserCallback):
    """Prints, on the Train controller, one line per failed rank of an attempt: the console's failure block."""

    def __init__(self) -> None:
        self.failures = 0

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self.failures += 1
        limit = run_context.get_run_config().failure_config.max_failures
        for rank, error in sorted(worker_exceptions.items()):
            print(f"{FAILURE_MARK} attempt failed ({self.failures} of max_failures={limit}): rank {rank}"
                  f"{describe_failure(error)}", flush=True)


def describe_failure(error: Exception) -> str:
    """A rank's failure in one line: `` (host H, pid P): how``."""
    return f"{_where(error)}: {_how(error)}"


def _where(error: Exception) -> str:
    """`` (host H, pid P)`` when Ray's error names them."""
    text = str(error)
    host, pid = _HOST.search(text), _PID.search(text)
    parts = [f"host {host.group(1)}" if host else "", f"pid {pid.group(1)}" if pid else ""]
    return f" ({', '.join(p for p in parts if p)})" if any(parts) else ""


def _how(error: Exception) -> str:
    """How the rank failed, in one line: its process died, or its error's type and message."""
    cause = getattr(error, "health_check_failure", None) or error  # Ray Train's health check wraps the death
    text = str(cause).strip()
    if "actor died" in text or "actor is dead" in text:
        exit_type = _EXIT_TYPE.search(text)
        return "its process died" + (f" (exit type {exit_type.group(1)})" if exit_type else "")
    lines = text.splitlines() or [""]
    if lines[0].startswith("Traceback"):  # the error with its traceback: its last line names it and says what
        return [line for line in lines if line and not line[0].isspace()][-1][:300]
    return f"{type(cause).__name__}: {lines[0][:300]}"
