"""What became of each finished save: counted, logged, and escalated when too many fail in a row.

Part of the checkpoint loop both modes drive. A failed save alone is logged, counted and retried at
the next interval (a failed final save at once, from memory); ``max_in_a_row`` failed saves in a row
raise :class:`CheckpointSaveError` rather than train on with nothing durable.
"""

from __future__ import annotations

import logging

from ray_resilient.checkpoint.writer import SaveResult

logger = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """The final checkpoint, or too many saves in a row, could not be made durable."""


class SaveOutcomes:
    """The finished saves of one writer, in order (see the module docstring)."""

    def __init__(self, max_in_a_row: int):
        if max_in_a_row < 1:
            raise ValueError(f"max_failed_saves_in_a_row must be >= 1, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.failed = 0  # saves that did not become durable
        self._in_a_row = 0

    def record(self, result: SaveResult) -> None:
        """Count one finished save; raise :class:`CheckpointSaveError` at ``max_in_a_row`` failures in a row."""
        if result.ok:
            self._in_a_row = 0
            return
        self.failed += 1
        self._in_a_row += 1
        if self._in_a_row >= self.max_in_a_row:
            raise CheckpointSaveError(
                f"{self._in_a_row} checkpoint saves in a row failed (the last, at step {result.step}: "
                f"{result.error}); stopping this attempt rather than training on with nothing durable. "
                "Check the storage (space, permissions, credentials)."
            )
        logger.error("Checkpoint at step %d not saved (%s); retrying at the next interval (%d failed so far)",
                     result.step, result.error, self.failed)
