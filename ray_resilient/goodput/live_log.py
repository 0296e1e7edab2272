"""The run's live goodput, logged as training goes: a lifecycle hook of rank 0's checkpoint loop."""

from __future__ import annotations

from collections.abc import Callable

from ray_resilient.lifecycle import LifecycleHook
from ray_resilient.tracking import BackgroundMetrics, MetricsLogger

FINAL_METRICS_WAIT_S = 10.0  # a clean end waits this long for the final figures to reach the logger


class LiveGoodputLog(LifecycleHook):
    """Logs ``figures()`` (the run's live goodput, empty until the restore accounted the ledger) to
    ``metrics_logger`` every ``every`` steps and once more as the attempt ends cleanly (the final
    figures, waited for up to :data:`FINAL_METRICS_WAIT_S` when the logger delivers in the
    background)."""

    def __init__(self, figures: Callable[[], dict[str, float]], metrics_logger: MetricsLogger, every: int):
        self._figures, self._logger, self._every = figures, metrics_logger, every
        self._step: int | None = None

    def step_finished(self, step: int) -> None:
        self._step = step
        if step % self._every == 0:
            self._log(step)

    def attempt_ended(self, failed: bool) -> None:
        if not failed and self._step is not None:
            self._log(self._step)
        if isinstance(self._logger, BackgroundMetrics):
            self._logger.flush(FINAL_METRICS_WAIT_S)

    def _log(self, step: int) -> None:
        figures = self._figures()
        if figures:
            self._logger(figures, step)
