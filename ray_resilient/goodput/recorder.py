"""What the checkpoint manager records into the ledger, and the live goodput it logs to MLflow.

Rank 0 records the attempt, its restore, every step and save; other ranks only their failures.
On rank 0 the breakdown is kept up to date as the loop runs: at the restore the earlier attempts'
events are read and accounted once (the restored step says which of their steps were lost), and
each step and save of this attempt adds to that, so live figures cost O(1) per step.
"""

from __future__ import annotations

import copy
import time
from collections import deque

from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.goodput.accounting import PARTS, Breakdown, account
from ray_resilient.goodput.ledger import LedgerWriter, read_events
from ray_resilient.tracking import BackgroundMetrics, MetricsLogger

FINAL_METRICS_WAIT_S = 10.0  # close() waits this long for the final goodput figures to reach MLflow


class GoodputRecorder:
    """Ledger events of this rank, and on rank 0 the run's live goodput.

    Args:
        storage: the run's storage (the ledger lives in its run directory).
        rank, world_size: this worker's.
        log_every: steps between two calls of ``metrics_logger`` (rank 0).
        metrics_logger: called with (goodput metrics, step); the default logs to the MLflow run
            of the current Ray Train run from a background thread (never blocking or failing
            the loop, :class:`~ray_resilient.tracking.BackgroundMetrics`); None logs nothing.
        window: steps of the rolling goodput.
    """

    def __init__(self, storage: CheckpointStorage, rank: int, world_size: int, *, log_every: int = 50,
                 metrics_logger: MetricsLogger | str | None = "mlflow", window: int = 100):
        self.rank = rank
        self._storage = storage
        self._writer = LedgerWriter(storage.filesystem, storage.experiment_path, rank, storage.local_dir)
        self._log_every, self._metrics_logger = log_every, metrics_logger if rank == 0 else None
        self._live: Breakdown | None = None
        self._start = time.time()
        self._window: deque[tuple[float, float, float]] = deque(maxlen=window)  # (t_start, t_end, productive)
        if rank == 0:
            self._writer.record("attempt_start", world_size=world_size)

    def restored(self, t_start: float, step: int) -> None:
        """The restore (or the check that found nothing) ended now, at ``step``."""
        if self.rank != 0:
            return
        self._writer.record("restore", t_start=t_start, step=step)
        self._writer.flush()  # this attempt's own events count too
        events = read_events(self._storage.filesystem, self._storage.experiment_path)
        now = time.time()
        self._live = account(events, now=now)
        self._start = now - self._live.total

    def step(self, step: int, t_start: float, t_end: float, data_wait: float) -> None:
        if self.rank != 0:
            return
        self._writer.record("step", t=t_end, step=step, t_start=t_start, data_wait=data_wait)
        if self._live is not None:
            duration = t_end - t_start
            wait = min(data_wait, duration)
            self._live.productive += duration - wait
            self._live.data_wait += wait
            self._live.steps_kept += 1
            self._window.append((t_start, t_end, duration - wait))
            if self._metrics_logger is not None and step % self._log_every == 0:
                self._log(step)

    def save(self, step: int, t_start: float, t_end: float) -> None:
        if self.rank != 0:
            return
        self._writer.record("save", t=t_end, step=step, t_start=t_start)
        if self._live is not None:
            self._live.save_stall += t_end - t_start

    def durable(self, step: int, t: float) -> None:
        if self.rank == 0:
            self._writer.record("durable", t=t, step=step)

    def registered(self, step: int) -> None:
        if self.rank == 0:
            self._writer.record("registered", step=step)

    def failure(self, error: BaseException) -> None:
        self._writer.record("failure", error=f"{type(error).__name__}: {error}"[:500])

    def finished(self, step: int) -> None:
        if self.rank == 0:
            self._writer.record("finish", step=step)
            if self._metrics_logger is not None and self._live is not None:
                self._log(step)  # the final figures

    def breakdown(self) -> Breakdown | None:
        """The run's breakdown until now (rank 0, after the restore), else None."""
        if self._live is None:
            return None
        live = copy.copy(self._live)
        live.total = time.time() - self._start
        live.other = live.total - sum(getattr(live, part) for part in PARTS if part != "other")
        return live

    def metrics(self) -> dict[str, float]:
        """Cumulative goodput, each part's share and the rolling goodput (empty before the restore)."""
        live = self.breakdown()
        if live is None:
            return {}
        metrics = live.as_metrics()
        if len(self._window) > 1:
            span = self._window[-1][1] - self._window[0][0]
            metrics["goodput_rolling"] = sum(p for _, _, p in self._window) / span if span > 0 else 0.0
        return metrics

    def _log(self, step: int) -> None:
        if self._metrics_logger == "mlflow":  # opened on first use, on the delivery thread
            from ray_resilient.tracking import MlflowMetrics, current_run_name

            run_name = current_run_name()
            self._metrics_logger = BackgroundMetrics(lambda: MlflowMetrics(run_name, prefix="goodput/"), "goodput")
        self._metrics_logger(self.metrics(), step)

    def close(self) -> None:
        if isinstance(self._metrics_logger, BackgroundMetrics):
            self._metrics_logger.flush(FINAL_METRICS_WAIT_S)
        self._writer.close()
