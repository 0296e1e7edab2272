"""The record format of the experiment kit: what each process of a chaos run did, and when.

Every process of a run (each attempt's workers, each replica, a replacement) appends typed events
(:class:`RecordKind`) with their time to a JSON-lines file of its own (:class:`Recorder`); every
train loop of the kit writes them and every analysis reads them (:func:`read_records`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any


class RecordKind(str, Enum):
    """What a process recorded; the fields each kind carries besides ``t``, ``kind``, ``rank``, ``pid``."""

    START = "start"  # the train function started; world_size, preloaded (PRELOAD_PROBES imported before)
    IMPORTED = "imported"  # its imports done
    MODEL_READY = "model_ready"  # model (DDP), optimizer and data built
    RESTORE_START = "restore_start"  # Checkpointer built, restore() called
    RESTORED = "restored"  # the state of a checkpoint loaded: its step (a baseline may resume before it)
    FIRST_BATCH = "first_batch"  # the first batch after the restore in hand
    JOINED = "joined"  # survivor mode: the replica's state is the run's at step; finished, sha (digest)
    STEP = "step"  # committed: step, epoch; parts ({part: sample ids}); survivor mode instead: members
    #                (those that trained it), loss, sha
    COMPUTED = "computed"  # survivor mode: a micro-batch computed: step (it trains), epoch, members, part, ids
    KILL = "kill"  # a timed kill fires now: step (the last committed), planned (its moment)
    FINISHED = "finished"  # the loop ended: step

    def __str__(self) -> str:
        return self.value


class Recorder:
    """Appends this process's records to ``<record_dir>/rank<r>-<pid>.jsonl``, one JSON object a line.

    Each line is one ``write`` of a file opened for it, so a SIGKILL loses nothing already recorded.
    """

    def __init__(self, record_dir: str | Path, rank: int):
        self.rank, self.pid = rank, os.getpid()
        self.path = Path(record_dir) / f"rank{rank}-{self.pid}.jsonl"

    def __call__(self, kind: RecordKind, t: float | None = None, **fields: Any) -> None:
        line = json.dumps({"t": time.time() if t is None else t, "kind": str(kind), "rank": self.rank,
                           "pid": self.pid, **fields})
        with open(self.path, "a") as out:
            out.write(line + "\n")


def read_records(record_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of every process in ``record_dir``, in time order."""
    records = []
    for path in Path(record_dir).glob("rank*-*.jsonl"):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["t"])


def of_kind(records: Sequence[dict[str, Any]], kind: RecordKind) -> list[dict[str, Any]]:
    """The records of one kind, in their order."""
    return [r for r in records if r["kind"] == kind]
