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
    STEP_DISCARDED = "step_discarded"  # survivor mode: a step dropped by a replica loss; step, t_start, world_size
    MEMBERSHIP = "membership"  # survivor mode: the replicas changed; step, world_size, lost, joined
    PEER_RECOVERY = "peer_recovery"  # survivor mode: state copied from a live replica; t_start, step, replicas, bytes
    HANG = "hang"  # the watchdog declared a rank hung: t_start (its last progress), hung_rank, host, phase, error

    def __str__(self) -> str:
        return self.value


# The fields the accounting reads from each kind, besides ``t`` and ``process``: numbers, except
# MEMBERSHIP's ``lost`` (a list of replicas). A line without them is not an event of the ledger.
REQUIRED_FIELDS: dict[EventKind, tuple[str, ...]] = {
    EventKind.JOB_START: (),
    EventKind.ATTEMPT_START: (),
    EventKind.RESTORE: ("t_start", "step"),
    EventKind.STEP: ("step", "t_start"),
    EventKind.SAVE: ("step", "t_start"),
    EventKind.DURABLE: ("step",),
    EventKind.REGISTERED: ("step",),
    EventKind.FAILURE: (),
    EventKind.FINISH: ("step",),
    EventKind.STEP_DISCARDED: ("step", "t_start"),
    EventKind.MEMBERSHIP: ("step", "lost"),
    EventKind.PEER_RECOVERY: ("t_start", "step"),
    EventKind.HANG: ("t_start",),
}
