"""When to save: every N steps or at Daly's interval for the job's MTBF, and before a preemption.

The :class:`~ray_resilient.checkpoint.checkpointer.Checkpointer` asks :meth:`SavePolicy.due` after
every step and tells the policy what each save cost; the policy holds no checkpoint state.
"""

from __future__ import annotations

import logging
from collections import deque
from statistics import median
from typing import Literal

import ray.train
import torch.distributed as dist

from ray_resilient.checkpoint.collectives import broadcast_from_rank0
from ray_resilient._ray_internals import local_preemption_info
from ray_resilient.goodput.planner import interval_steps_for

logger = logging.getLogger(__name__)

AUTO_FIRST_STEPS = 10  # interval_steps="auto": the first checkpoint, which measures the save stall
STEP_WINDOW = 50  # "auto": the median of this many recent step times


class SavePolicy:
    """Decides, the same way on every rank, whether the step just finished is saved.

    Args:
        interval_steps: save every this many steps, ``"auto"``: the interval that maximizes
            goodput for ``mtbf_s`` (Daly's, :mod:`ray_resilient.goodput.planner`) from the
            measured cost of a save (its stall, plus what its background write cost the steps
            beside it beyond a step's usual time) and step time (a first save after
            :data:`AUTO_FIRST_STEPS` steps measures them, and every save updates the interval from
            rank 0's figures), or None: never (only the final save and preemption saves).
        mtbf_s: the job's mean time between failures in seconds (needed by ``"auto"``).
        preemption_check_steps: ask Ray for imminent preemption every this many steps (a
            barrier across workers, a few ms); a just-in-time save follows once.
        asks_alone: this worker asks without the others (survivor mode's lead): its own copy of
            the worker group's preemption signal, no barrier.
    """

    def __init__(self, interval_steps: int | Literal["auto"] | None = 100, *, mtbf_s: float | None = None,
                 preemption_check_steps: int = 10, asks_alone: bool = False):
        if interval_steps == "auto":
            if mtbf_s is None or mtbf_s <= 0:
                raise ValueError(f'interval_steps="auto" needs the job\'s mtbf_s (seconds, > 0), got {mtbf_s}')
        elif interval_steps is not None and (not isinstance(interval_steps, int) or interval_steps < 1):
            raise ValueError(f'interval_steps must be an int >= 1, "auto" or None, got {interval_steps!r}')
        if preemption_check_steps < 1:
            raise ValueError(f"preemption_check_steps must be >= 1, got {preemption_check_steps}")
        self.auto = interval_steps == "auto"
        self.interval_steps = AUTO_FIRST_STEPS if self.auto else interval_steps or 0  # 0: none
        self.mtbf_s = mtbf_s
        self.preemption_check_steps = preemption_check_steps
        self._preemption_info = local_preemption_info if asks_alone else ray.train.get_preemption_info
        self.saved_for_preemption = False  # a just-in-time checkpoint was taken
        self._next_auto_save = AUTO_FIRST_STEPS
        self._step_seconds: deque[float] = deque(maxlen=STEP_WINDOW)  # steps with no write beside them
        self._beside_write: list[float] = []  # the steps beside the newest save's write

    def restored(self, step: int, interval_steps: int = 0) -> None:
        """The run continues after ``step``; ``interval_steps`` is the interval its checkpoint was
        saved under (0: none recorded). ``"auto"`` continues with it, instead of measuring again
        from :data:`AUTO_FIRST_STEPS`; the next interval counts from ``step``."""
        if self.auto and interval_steps > 0:
            self.interval_steps = interval_steps
        self._next_auto_save = step + self.interval_steps

    def step_finished(self, seconds: float, beside_write: bool = False) -> None:
        """A step took ``seconds``; ``beside_write``: a save's write ran beside it."""
        if beside_write:
            self._beside_write.append(seconds)
        else:
            self._step_seconds.append(seconds)

    def due(self, step: int) -> bool:
        """Whether the interval says to save after ``step``."""
        if self.auto:
            return step >= self._next_auto_save
        return self.interval_steps > 0 and step % self.interval_steps == 0

    def preemption_imminent(self, step: int) -> bool:
        """Whether Ray announced a preemption (asked every ``preemption_check_steps``; true once)."""
        if self.saved_for_preemption or step % self.preemption_check_steps:
            return False
        info = self._preemption_info()
        if info is None:
            return False
        logger.warning("Preemption of ranks %s imminent: saving a just-in-time checkpoint", info.preempted_ranks)
        self.saved_for_preemption = True
        return True

    def saved(self, step: int, stall_s: float, durable_s: float, group: dist.ProcessGroup | None) -> None:
        """A save started after ``step``, stalling the loop ``stall_s``; the newest durable one took
        ``durable_s``. With ``"auto"``, the next interval is Daly's from rank 0's figures (at least
        its time to durable), the same on every rank (a collective on ``group``): a save costs its
        stall plus the previous save's interference, what the steps beside its write took beyond
        the median step without one."""
        beside, self._beside_write = self._beside_write, []
        if not self.auto:
            return
        usual = median(self._step_seconds or beside)
        interference = max(0.0, sum(beside) - len(beside) * usual)
        stall, step_seconds, durable, interference = broadcast_from_rank0(
            group, (stall_s, usual, durable_s, interference))
        cost = stall + interference
        interval = interval_steps_for(self.mtbf_s, max(cost, 1e-6), max(step_seconds, 1e-6), durable)
        if interval != self.interval_steps:
            logger.info("Checkpoint interval: %d steps (Daly's for an MTBF of %.0fs, a save costing %.3fs: its stall "
                        "%.3fs and %.3fs more of the steps beside its write; step %.3fs; a save is durable after "
                        "%.3fs)", interval, self.mtbf_s, cost, stall, interference, step_seconds, durable)
        self.interval_steps = interval
        self._next_auto_save = step + interval
