"""Fault injection at real points of a run: off unless configured, each fault fires once per run
(a pause in every attempt that passes it, a partition in the processes that trained its step).

A plan is a ``;``-separated list of ``ACTION:POINT=STEP[:rank=R][:seconds=S][:peer=P]``, taken from the
job's command line or the ``RAY_RESILIENT_FAULTS`` environment variable:

- ACTION: ``kill`` (SIGKILL this worker process), ``stop`` (SIGSTOP it: a hang without dying,
  as a stuck process or a partitioned node looks; only at ``step``), ``raise`` (raise :class:`InjectedFault`),
  ``fail_write`` (make the checkpoint write fail with an ``OSError``), ``slow_write`` (storage
  slower than the interval: the write of that step's checkpoint sleeps ``seconds=S`` more),
  ``pause`` (the training thread sleeps ``seconds=S``, answering but making no progress, as a
  recompile, a long evaluation or a slow restore does; at ``step`` or ``restore``, and in every
  attempt that passes the point, not once per run), ``preempt`` (a preemption notice, as
  ``ray.train.get_preemption_info`` gives one: the checkpointer takes its just-in-time save after
  that step; only at ``step``, and on every rank the plan names: plan it on each), ``partition``
  (survivor mode: replicas R and ``peer=P`` can no longer reach each other, though both reach
  the coordinator: the exchanges and the groups they are both in fail on both, as across a
  network partition; in the processes that trained STEP, until one of the two leaves the
  membership; only at ``step``).
- POINT: ``step`` (after that training step), ``staging`` (while staging the checkpoint of that
  step), ``upload`` (while writing/uploading it, after part of it is written), ``durable``
  (after it is durable, before Ray registers it), ``copy`` (survivor mode: while a replica sends
  its state to the replicas behind it, after the layout, before the tensors), ``register``
  (survivor mode: a replica about to make its part of registering the lead's checkpoint of that
  step with Ray), ``restore`` (a ``Checkpointer``, or a survivor membership's source, restoring,
  before it reads; STEP 0). These points but ``step`` fire on the first save (or copy, or
  registration) at or after STEP: a save due while the ones before are still being written is
  deferred a step.

Example: ``kill:step=7:rank=1;kill:upload=20`` kills rank 1 after step 7, then rank 0 (the
default rank) in the middle of writing the checkpoint of step 20. A fault fires once per run:
before firing it leaves a marker in the run's storage, so the restarted attempt goes past it.
:func:`random_kill_plan` draws a seeded plan of kills at random moments.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from dataclasses import dataclass

import pyarrow.fs as pafs

logger = logging.getLogger(__name__)

FAULTS_ENV = "RAY_RESILIENT_FAULTS"
ACTIONS = ("kill", "stop", "raise", "fail_write", "slow_write", "pause", "preempt", "partition")
POINTS = ("step", "staging", "upload", "durable", "copy", "register", "restore")
TIMED = ("slow_write", "pause")  # the actions that take seconds=S


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int
    rank: int = 0
    seconds: float = 0.0  # slow_write's delay, pause's length
    peer: int = -1  # partition's other replica

    @property
    def marker(self) -> str:
        return f"{self.action}-{self.point}-{self.step}-rank{self.rank}"


def parse_faults(spec: str) -> list[Fault]:
    """Parse a fault plan; raises ValueError naming the bad entry and the expected form."""
    faults = []
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        fields = entry.split(":")
        try:
            action = fields[0]
            point, step = fields[1].split("=")
            extras = {"rank": "0", "seconds": "0", "peer": "-1"}
            for extra in fields[2:]:
                key, value = extra.split("=")
                if key not in extras:
                    raise ValueError(key)
                extras[key] = value
            fault = Fault(action, point, int(step), int(extras["rank"]), float(extras["seconds"]), int(extras["peer"]))
        except (IndexError, ValueError) as err:
            raise ValueError(
                f"bad fault {entry!r}: expected ACTION:POINT=STEP[:rank=R][:seconds=S][:peer=P], "
                "e.g. kill:step=7:rank=1"
            ) from err
        if fault.action not in ACTIONS or fault.point not in POINTS:
            raise ValueError(f"bad fault {entry!r}: action must be one of {ACTIONS}, point one of {POINTS}")
        if fault.action in ("stop", "preempt", "partition") and fault.point != "step":
            raise ValueError(f"bad fault {entry!r}: {fault.action} goes only with the step point")
        if fault.action == "pause" and fault.point not in ("step", "restore"):
            raise ValueError(f"bad fault {entry!r}: pause goes only with the step and restore points")
        if (fault.action == "partition") != (fault.peer >= 0) or fault.peer == fault.rank:
            raise ValueError(f"bad fault {entry!r}: peer=P (another rank) goes with partition, and only with it")
        if (fault.action in TIMED) != (fault.seconds > 0):
            raise ValueError(f"bad fault {entry!r}: seconds=S (> 0) goes with {' and '.join(TIMED)}, "
                             "and only with them")
        faults.append(fault)
    return faults


def random_kill_plan(seed: int, *, kills: int, steps: int, interval: int, world_size: int, upload_kills: int = 1) -> str:
    """A seeded plan of ``kills`` SIGKILLs at random moments of a ``steps``-step run, each of a random rank.

    ``upload_kills`` of them strike while a checkpoint (one every ``interval`` steps, before the
    last step) is being written; the others after random training steps. The same arguments
    always give the same plan.
    """
    rng = random.Random(seed)
    checkpoint_steps = list(range(interval, steps, interval))
    if upload_kills > len(checkpoint_steps) or kills - upload_kills > steps - 1 or upload_kills > kills:
        raise ValueError(f"cannot place {kills} kills ({upload_kills} during uploads) in {steps} steps "
                         f"with a checkpoint every {interval}")
    upload = rng.sample(checkpoint_steps, upload_kills)
    after_step = rng.sample(range(1, steps), kills - upload_kills)
    faults = [Fault("kill", "upload", s, rng.randrange(world_size)) for s in upload]
    faults += [Fault("kill", "step", s, rng.randrange(world_size)) for s in after_step]
    return ";".join(f"{f.action}:{f.point}={f.step}:rank={f.rank}" for f in sorted(faults, key=lambda f: f.step))


class FaultInjector:
    """Fires the faults of a plan on this rank, once per run (markers under ``marker_dir``; a
    pause in every attempt; a partition in this process, :attr:`unreachable`)."""

    def __init__(self, faults: list[Fault], rank: int, filesystem: pafs.FileSystem, marker_dir: str):
        self.faults = [f for f in faults if f.rank == rank and f.action != "partition"]
        self._partitions = [(f.step, f.peer if f.rank == rank else f.rank)
                            for f in faults if f.action == "partition" and rank in (f.rank, f.peer)]
        self.filesystem = filesystem
        self.marker_dir = marker_dir
        self._preemption_notice = False
        self.unreachable: set[int] = set()  # ranks a partition cut this process off from

    @classmethod
    def from_plan(
        cls, plan: str | None, rank: int, filesystem: pafs.FileSystem, experiment_path: str
    ) -> "FaultInjector":
        """The injector for ``plan`` (``RAY_RESILIENT_FAULTS`` when None), markers in the run dir."""
        spec = os.environ.get(FAULTS_ENV, "") if plan is None else plan
        return cls(parse_faults(spec), rank, filesystem, f"{experiment_path}/.faults")

    def fire(self, point: str, step: int) -> None:
        """Fire the fault planned at (point, step) unless it already fired in this run; at a point
        other than ``step``, also one planned at an earlier step (a save deferred past it)."""
        for at, other in self._partitions:
            if point == "step" and at == step:
                logger.warning("Injecting fault partition-step-%d: cut off from rank %d", step, other)
                self.unreachable.add(other)
        for fault in self.faults:
            due = fault.step == step if point == "step" else fault.step <= step
            if fault.point == point and due and fault.action == "pause":
                logger.warning("Injecting fault %s (%.1f s)", fault.marker, fault.seconds)
                time.sleep(fault.seconds)
            elif fault.point == point and due and self._claim(fault):
                logger.warning("Injecting fault %s", fault.marker)
                if fault.action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault.action == "stop":  # every thread stops; SIGCONT (or SIGKILL) from outside
                    os.kill(os.getpid(), signal.SIGSTOP)
                    continue
                if fault.action == "fail_write":
                    raise OSError(f"injected storage write failure ({fault.marker})")
                if fault.action == "slow_write":
                    time.sleep(fault.seconds)
                    continue
                if fault.action == "preempt":
                    self._preemption_notice = True
                    continue
                raise InjectedFault(fault.marker)

    def take_preemption_notice(self) -> bool:
        """Whether a ``preempt`` fault fired since the last call."""
        notice, self._preemption_notice = self._preemption_notice, False
        return notice

    def _claim(self, fault: Fault) -> bool:
        path = f"{self.marker_dir}/{fault.marker}"
        if self.filesystem.get_file_info(path).type != pafs.FileType.NotFound:
            return False
        self.filesystem.create_dir(self.marker_dir)
        with self.filesystem.open_output_stream(path) as out:
            out.write(b"fired\n")
        return True
