"""The lead replica's checkpoints: the checkpoint loop (:mod:`~ray_resilient.checkpoint.loop`) as a
one-rank job, whose durable checkpoints wait to be offered to Ray (:class:`~.registrations.Offers`).

The lead holds the run directory's lease (one driver per run, as the mainline's rank 0) and saves
plain DCP checkpoints in the background: the safety net for losing every replica holding state, or
the driver. A replica becomes the lead by restoring from storage (a membership without a replica
holding state) or by taking over from a lost lead with the state in its memory; either way it takes
the lease's next generation, so a lost lead's checkpoint names are never reused.
"""

from __future__ import annotations

from typing import Any

from ray_resilient.checkpoint.config import CheckpointConfig
from ray_resilient.checkpoint.loop import CheckpointLoop
from ray_resilient.checkpoint.save_outcomes import CheckpointSaveError
from ray_resilient.checkpoint.state import TrainingComponents
from ray_resilient.faults import FaultInjector
from ray_resilient.goodput.events import EventKind
from ray_resilient.survivors.registrations import Offers

FinalSaveFailed = CheckpointSaveError  # the lead could not make the final checkpoint durable: every replica raises it


class Lead:
    """This replica's part as the lead (see the module docstring).

    Args:
        components, config: what the checkpoints capture, and how and when they are made.
        faults: the replica's fault injector (its ``step`` faults the replica fires itself).
        offers: the replica's offers, the loop's registrar.
        replicas: the run's replicas (the attempt's size in the goodput ledger).
    """

    def __init__(self, components: TrainingComponents, config: CheckpointConfig, faults: FaultInjector,
                 offers: Offers, replicas: int):
        self._loop = CheckpointLoop(components, config, rank=0, world_size=1, registrar=offers, faults=faults,
                                    step_faults=False, recorded_world_size=replicas)

    def restore(self) -> int:
        """Take the lease, restore the newest complete checkpoint (or keep the state built): its step."""
        return self._loop.restore().step

    def take_over(self, step: int) -> None:
        """Take the lease from a lost lead and go on from the state in memory at ``step``."""
        self._loop.take_over(step)

    def step_finished(self, started: float) -> None:
        """The step begun at wall time ``started`` was applied: record it, save when due."""
        self._loop.step_finished(0, started=started)

    def progress(self, phase: str) -> None:
        self._loop.progress(phase)

    def finish(self, result_metrics: dict[str, Any]) -> dict[str, Any]:
        """Make the last step durable (again from memory while it fails; ``CheckpointSaveError``
        after too many); the metrics its registration reports."""
        self._loop.finish(result_metrics)
        return {**result_metrics, **self._loop.goodput_metrics()}

    def event(self, kind: EventKind, **fields: Any) -> None:
        """An event of the run's progress for the goodput ledger."""
        self._loop.event(kind, **fields)

    def close(self, error: BaseException | None) -> None:
        self._loop.close(error)
