"""When a process that sends heartbeats has stopped: silent for longer than the run's heartbeats
are ever late.

A stopped process (SIGSTOP, a lost node, a partition) sends nothing; a live one starved of CPU on a
loaded machine sends late. So a fixed threshold either takes a starved process for a stopped one or
waits long for a stopped one. :class:`SilenceRule` learns the gaps between the heartbeats it hears
(every process it watches) and counts silence as a stop beyond ``max(floor_s, SILENCE_MULTIPLE x``
their p99``)``: the floor (2 s) on a quiet machine, more where heartbeats have been late. The hang
watchdog (:mod:`.monitor`) and survivor mode's coordinator
(:mod:`ray_resilient.survivors.liveness`) judge silence by it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

SILENCE_MULTIPLE = 4.0  # x the p99 of the heartbeat gaps heard, where that is more than the floor
GAP_WINDOW = 2000  # recent heartbeat gaps (every process's) whose p99 counts


def p99(values: Sequence[float]) -> float:
    """The 99th percentile of ``values`` (at least one): the smallest value at or above 99% of them."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class SilenceRule:
    """The silence threshold of the processes one watcher hears (see the module docstring)."""

    def __init__(self, floor_s: float = 2.0):
        if not floor_s > 0:
            raise ValueError(f"a silence floor must be > 0 s, got {floor_s!r}")
        self.floor_s = floor_s
        self._gaps: deque[float] = deque(maxlen=GAP_WINDOW)

    def heard(self, gap_s: float) -> None:
        """A heartbeat came ``gap_s`` after the one before it from the same process."""
        self._gaps.append(gap_s)

    @property
    def threshold_s(self) -> float:
        """How long a process may send nothing before it counts as stopped."""
        return max(self.floor_s, SILENCE_MULTIPLE * p99(self._gaps)) if self._gaps else self.floor_s
