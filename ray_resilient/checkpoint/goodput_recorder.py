"""What a checkpointer (or survivor mode's lead) records into the goodput ledger, and the run's
live goodput (logged by :class:`~ray_resilient.goodput.live_log.LiveGoodputLog`, a lifecycle hook).

Rank 0 records the attempt, its restore, every step and save; other ranks only their failures.
On rank 0 the breakdown is kept up to date as the loop runs: at the restore (or when survivor
mode's new lead takes over) the run's ledger so far is read and accounted once (the restored
step says which of its steps were lost), and each step and save adds to that, so live figures
cost O(1) per step. That read stores the summary of each ended attempt it had to fold from its
events, so that the next ones read summaries (:mod:`~ray_resilient.goodput.ledger`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque

from ray_resilient.goodput.accounting import PARTS, Breakdown
from ray_resilient.goodput.events import EventKind
from ray_resilient.goodput.ledger import Ledger, LedgerWriter, read_ledger, store_summaries
from ray_resilient.storage.run import RunStorage

logger = logging.getLogger(__name__)


class GoodputRecorder:
    """Ledger events of this rank, and on rank 0 the run's live goodput.

    Args:
        storage: the run's storage (the ledger lives in its run directory).
        rank: this worker's.
        window: steps of the rolling goodput.
    """

    def __init__(self, storage: RunStorage, rank: int, *, window: int = 100):
        self.rank = rank
        self._storage = storage
        self._writer = LedgerWriter(storage, rank)
        self._live: Breakdown | None = None
        self._start = time.time()
        self._window: deque[tuple[float, float, float]] = deque(maxlen=window)  # (t_start, t_end, productive)

    def attempt_started(self, world_size: int) -> None:
        """A new attempt of the run (a worker group restoring from storage) starts now."""
        if self.rank == 0:
            self._writer.record(EventKind.ATTEMPT_START, world_size=world_size)

    def restored(self, t_start: float, step: int) -> None:
        """The restore (or the check that found nothing) ended now, at ``step``."""
        if self.rank != 0:
            return
        self._writer.record(EventKind.RESTORE, t_start=t_start, step=step)
        self.follow_run()

    def follow_run(self) -> None:
        """Account the run's ledger so far (this recorder's own events included), then keep the
        figures live; a ledger that cannot be read leaves this attempt without live figures, nothing
        more. Stores the summaries of the ended attempts it folded from their events."""
        self._writer.flush()
        try:
            ledger = read_ledger(self._storage.filesystem, self._storage.experiment_path)
            now = time.time()
            self._live = ledger.account(now=now)
        except Exception:  # noqa: BLE001 - the ledger is a record; the run does not depend on it
            logger.warning("The goodput ledger of %s cannot be read: no live goodput for this attempt",
                           self._storage.experiment_path, exc_info=True)
            return
        self._start = now - self._live.total
        self._store_summaries(ledger)

    def _store_summaries(self, ledger: Ledger) -> None:
        """Store the summaries of the attempts ``ledger`` folded from their events, but this one's
        (open): every other has ended when an attempt restores or a lead takes over."""
        ended = [a for a in ledger.folded if a.process != self._writer.process]
        try:
            store_summaries(self._storage.filesystem, self._storage.experiment_path, ended)
        except Exception:  # noqa: BLE001 - the next restore folds their events again
            logger.warning("Could not store the goodput ledger's summaries of %d ended attempts", len(ended),
                           exc_info=True)

    def step(self, step: int, t_start: float, t_end: float, data_wait: float) -> None:
        if self.rank != 0:
            return
        self._writer.record(EventKind.STEP, t=t_end, step=step, t_start=t_start, data_wait=data_wait)
        if self._live is not None:
            duration = t_end - t_start
            wait = min(data_wait, duration)
            self._live.step_time += duration - wait
            self._live.kept_step_seconds.append(duration - wait)
            self._live.data_wait += wait
            self._live.steps_kept += 1
            self._window.append((t_start, t_end, duration - wait))

    def save(self, step: int, t_start: float, t_end: float) -> None:
        if self.rank != 0:
            return
        self._writer.record(EventKind.SAVE, t=t_end, step=step, t_start=t_start)
        if self._live is not None:
            self._live.save_stall += t_end - t_start

    def durable(self, step: int, t: float) -> None:
        if self.rank == 0:
            self._writer.record(EventKind.DURABLE, t=t, step=step)

    def registered(self, step: int) -> None:
        if self.rank == 0:
            self._writer.record(EventKind.REGISTERED, step=step)

    def event(self, kind: EventKind, **fields) -> None:
        """Another event of the run's progress (survivor mode's membership changes, dropped steps,
        state copies), recorded on rank 0; the live figures catch up on it at the next restore."""
        if self.rank == 0:
            self._writer.record(kind, **fields)

    def failure(self, error: BaseException) -> None:
        self._writer.record(EventKind.FAILURE, error=f"{type(error).__name__}: {error}"[:500])

    def finished(self, step: int) -> None:
        if self.rank == 0:
            self._writer.record(EventKind.FINISH, step=step)

    def breakdown(self) -> Breakdown | None:
        """The run's breakdown until now (rank 0, after the restore), else None."""
        if self._live is None:
            return None
        self._live.reference_step_seconds  # noqa: B018 - computed once on the live figures, kept by the copy
        live = copy.copy(self._live)
        live.total = time.time() - self._start
        live.other = live.total - sum(getattr(live, part) for part in PARTS if part != "other")
        return live

    def metrics(self) -> dict[str, float]:
        """Cumulative goodput, each part's share, the rolling goodput and the ledger's events lost to
        spool errors (empty before the restore)."""
        live = self.breakdown()
        if live is None:
            return {}
        metrics = live.as_metrics() | {"ledger_events_lost": self._writer.spool_errors}
        if len(self._window) > 1:
            span = self._window[-1][1] - self._window[0][0]
            metrics["goodput_rolling"] = sum(p for _, _, p in self._window) / span if span > 0 else 0.0
        return metrics

    def close(self) -> None:
        self._writer.close()
        if self._writer.spool_errors:
            logger.warning("%d events of this process were lost from the goodput ledger (its spool could not be "
                           "written): the run's goodput misses them", self._writer.spool_errors)
