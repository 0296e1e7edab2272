"""The kinds of event in the goodput ledger (each a string in the ledger's JSON lines)."""

from __future__ import annotations

from enum import Enum


class EventKind(str, Enum):
    """What happened; the fields each kind carries besides ``t``, ``kind``, ``process``, ``rank``."""

    JOB_START = "job_start"  # a driver called fit()
    ATTEMPT_START = "attempt_start"  # world_size
    RESTORE = "restore"  # t_start, the restored step
    STEP = "step"  # step, t_start, data_wait
    SAVE = "save"  # the loop's stall: step, t_start
    DURABLE = "durable"  # a checkpoint's step
    REGISTERED = "registered"  # a checkpoint's step
    FAILURE = "failure"  # error
    FINISH = "finish"  # step

    def __str__(self) -> str:
        return self.value
