"""Goodput accounting: every second of a run, across restarts, from its ledger's events.

The events (see :mod:`ray_resilient.goodput.ledger`) are wall-clock (``time.time()``) records
of attempts, restores, steps, checkpoint saves and the driver's starts. The total is the wall
time from the run's first start (the first driver's ``job_start``, else the first attempt's
start) to its last event. It is split into parts that add up to it:

- ``productive``: time in training steps whose result was kept, less their data wait, each step
  counted up to the run's reference step time.
- ``slow_steps``: what kept steps took beyond the reference step time: a step that is slower than
  the run's best steady stretch (a slowed node, background work, fewer replicas doing the same
  work) is not all progress. The reference is the median step of the run's best steady stretch
  (the lowest median over ``STEADY_STEPS`` consecutive kept steps; over all of them in a shorter
  run), or one the caller passes (another mode's step time, to compare modes), as Google's
  goodput library reports step-time deviation.
- ``wasted``: whole steps computed and then lost to a failure: a step is lost when a later
  attempt restored a checkpoint older than it (so it was recomputed, its number recorded again).
- ``data_wait``: time kept steps spent waiting for their batch (the loader's ``fetch_seconds``).
- ``save_stall``: time the loop stopped for checkpoint saves (staging; the final save is waited for).
- ``restore``: time loading checkpoints at the start of attempts.
- ``hang``: from a rank's last progress to the hang watchdog declaring it hung
  (:mod:`ray_resilient.watchdog`): the end of the hung attempt, which no step or save covers.
- ``init_restart``: from the run's start, or from the previous attempt's last event (the rest of
  a killed attempt's last step included), to the attempt's first work: starting the driver and
  the workers, building the model, failure detection (but a hang's), restarts.
- ``other``: the remainder: time the loop spent outside the events (e.g. after the last step).

In survivor mode (:mod:`ray_resilient.survivors`) the lead replica records the run as its rank 0.
A step dropped because a replica was lost is ``wasted`` and counts as recomputed; re-forming the
group until the next step starts is ``init_restart``, except the state copy to the replicas
behind (``peer_recovery``), which is ``restore``; each lost replica is a failure. When the lead
itself is lost, the replica that takes over continues the run as a new lane without a restore.

A step's time is from the previous mark of the loop (the end of the previous step's save, or of
the restore) to its ``step_completed``, so anything the loop does between steps (logging, a
validation pass) counts as part of the next step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ray_resilient.goodput.events import EventKind

PARTS = ("productive", "slow_steps", "wasted", "data_wait", "save_stall", "restore", "hang", "init_restart", "other")
STEADY_STEPS = 20  # the length of the stretch whose median step is the reference
STEADY_STRIDE = 5  # stretches start every this many kept steps


def steady_step_seconds(step_seconds: Sequence[float]) -> float | None:
    """The median step of the best steady stretch of ``step_seconds`` (kept steps in run order): the
    lowest median over ``STEADY_STEPS`` consecutive steps, or the median of all in a shorter run.
    In numpy: rank 0 computes it for its live figures, over every step of the run so far."""
    if not step_seconds:
        return None
    if len(step_seconds) <= STEADY_STEPS:
        return float(np.median(step_seconds))
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(step_seconds), STEADY_STEPS)[::STEADY_STRIDE]
    return float(np.median(windows, axis=1).min())


@dataclass(frozen=True)
class Attempt:
    """One start of the workers: rank 0's events of it, in time order."""

    process: str  # the ledger's id of the attempt's rank-0 process
    events: list[dict[str, Any]]

    @property
    def start(self) -> float:
        return self.events[0]["t"]

    @property
    def end(self) -> float:
        return self.events[-1]["t"]

    @property
    def restored_step(self) -> int | None:
        """The step it resumed from (0: a fresh start); None when it died before restoring."""
        return next((e["step"] for e in self.events if e["kind"] == EventKind.RESTORE), None)

    @property
    def finished(self) -> bool:
        return any(e["kind"] == EventKind.FINISH for e in self.events)

    @property
    def took_over(self) -> bool:
        """A survivor-mode lead that took over a running run (no start of its own)."""
        return not any(e["kind"] == EventKind.ATTEMPT_START for e in self.events)

    def first_work(self) -> float:
        """When the attempt started restoring or training (its end if it never did)."""
        work = (EventKind.RESTORE, EventKind.STEP, EventKind.SAVE, EventKind.STEP_DISCARDED)
        return next((e["t_start"] for e in self.events if e["kind"] in work), self.end)


@dataclass
class Breakdown:
    """Seconds of each part of a run's wall time (they add up to ``total``), and counts.

    ``step_time`` is the kept steps' time less their data wait: ``productive`` plus ``slow_steps``,
    which are measured against ``reference_step_seconds`` (given, or the run's own: see the module
    docstring)."""

    total: float = 0.0
    step_time: float = 0.0
    wasted: float = 0.0
    data_wait: float = 0.0
    save_stall: float = 0.0
    restore: float = 0.0
    hang: float = 0.0
    init_restart: float = 0.0
    other: float = 0.0
    attempts: int = 0
    failures: int = 0
    steps_kept: int = 0
    steps_recomputed: int = 0
    kept_step_seconds: list[float] = field(default_factory=list, repr=False)
    save_stalls: list[float] = field(default_factory=list, repr=False)
    durable_latencies: list[float] = field(default_factory=list, repr=False)  # each save's start to durable
    starts: list[float] = field(default_factory=list, repr=False)  # each attempt's init_restart + restore
    given_reference: float | None = None  # a reference step time passed by the caller
    _slow: tuple[int, float | None, float] = field(default=(0, None, 0.0), repr=False, compare=False)

    def _slow_steps(self) -> tuple[float | None, float]:
        """(reference step time, slow steps' seconds), computed once per number of kept steps."""
        count = len(self.kept_step_seconds)
        if self._slow[0] != count or count == 0:
            reference = self.given_reference or steady_step_seconds(self.kept_step_seconds)
            slow = float(np.maximum(np.asarray(self.kept_step_seconds) - reference, 0.0).sum()) if reference else 0.0
            self._slow = (count, reference, slow)
        return self._slow[1], self._slow[2]

    @property
    def reference_step_seconds(self) -> float | None:
        """The step time kept steps are measured against (None: no kept step, none given)."""
        return self._slow_steps()[0]

    @property
    def slow_steps(self) -> float:
        return self._slow_steps()[1]

    @property
    def productive(self) -> float:
        return self.step_time - self.slow_steps

    @property
    def restarts(self) -> list[float]:
        """The start costs of the attempts after the first: the whole cost of each restart."""
        return self.starts[1:]

    @property
    def goodput(self) -> float:
        return self.productive / self.total if self.total > 0 else 0.0

    def shares(self) -> dict[str, float]:
        """Each part as a fraction of the total."""
        return {part: (getattr(self, part) / self.total if self.total > 0 else 0.0) for part in PARTS}

    def as_metrics(self, prefix: str = "") -> dict[str, float]:
        """Goodput, each part's seconds and share, and the counts, as flat metrics."""
        metrics: dict[str, float] = {f"{prefix}goodput": self.goodput, f"{prefix}total_seconds": self.total}
        for part, share in self.shares().items():
            metrics[f"{prefix}{part}_seconds"] = getattr(self, part)
            if part != "productive":
                metrics[f"{prefix}badput_{part}"] = share
        for count in ("attempts", "failures", "steps_kept", "steps_recomputed"):
            metrics[f"{prefix}{count}"] = getattr(self, count)
        if self.reference_step_seconds is not None:
            metrics[f"{prefix}reference_step_seconds"] = self.reference_step_seconds
        return metrics

    def summary(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if not isinstance(v, (list, tuple)) and k != "given_reference"}
        return fields | {"productive": self.productive, "slow_steps": self.slow_steps,
                         "reference_step_seconds": self.reference_step_seconds, "goodput": self.goodput}


def group_attempts(events: Iterable[Mapping[str, Any]]) -> tuple[list[Attempt], list[float]]:
    """Rank 0's events grouped into attempts (in start order), and the drivers' start times."""
    by_process: dict[str, list[dict[str, Any]]] = {}
    job_starts = []
    for event in events:
        if event["kind"] == EventKind.JOB_START:
            job_starts.append(event["t"])
        elif event.get("rank", 0) == 0:
            by_process.setdefault(event["process"], []).append(dict(event))
    attempts = [Attempt(p, sorted(evs, key=lambda e: e["t"])) for p, evs in by_process.items()]
    return sorted(attempts, key=lambda a: a.start), sorted(job_starts)


def lost_after(attempts: list[Attempt], index: int) -> int | None:
    """The step above which attempt ``index``'s steps were computed again by a later attempt (None:
    every step kept). An attempt that died before restoring recomputed nothing and does not count."""
    restores = [a.restored_step for a in attempts[index + 1:] if a.restored_step is not None]
    return min(restores) if restores else None


def account(events: Iterable[Mapping[str, Any]], now: float | None = None,
            reference_step_seconds: float | None = None) -> Breakdown:
    """The breakdown of a run's wall time from its events (up to ``now``, default the last event);
    slow steps measured against ``reference_step_seconds`` (default: the run's own)."""
    if reference_step_seconds is not None and not reference_step_seconds > 0:
        raise ValueError(f"reference_step_seconds must be > 0, got {reference_step_seconds!r}")
    events = list(events)
    attempts, job_starts = group_attempts(events)
    hangs = [(e["t_start"], e["t"]) for e in events if e["kind"] == EventKind.HANG]
    result = Breakdown(given_reference=reference_step_seconds)
    if not attempts:
        return result
    start = min([attempts[0].start, *job_starts])
    end = max(a.end for a in attempts) if now is None else now
    result.total = end - start
    result.attempts = len(attempts)
    result.hang = sum(max(0.0, min(t, end) - max(t_start, start)) for t_start, t in hangs)
    boundary = start
    for index, attempt in enumerate(attempts):
        lost = lost_after(attempts, index)
        setup = max(0.0, attempt.first_work() - boundary)
        hung = sum(max(0.0, min(t, attempt.first_work()) - max(t_start, boundary)) for t_start, t in hangs)
        result.init_restart += max(0.0, setup - hung)  # a hang that ran into this gap is the hang's
        # A save's durable event may come before the save's own (the writer's thread records it).
        save_started = {e["step"]: e["t_start"] for e in attempt.events if e["kind"] == EventKind.SAVE}
        restored = 0.0
        reforming_since, copying = None, 0.0  # survivor mode: since a step was dropped
        for event in attempt.events:
            duration = event["t"] - event.get("t_start", event["t"])
            if event["kind"] == EventKind.STEP and reforming_since is not None:
                result.init_restart += max(0.0, event["t_start"] - reforming_since - copying)
                reforming_since, copying = None, 0.0
            if event["kind"] == EventKind.STEP:
                if lost is not None and event["step"] > lost:
                    result.wasted += duration
                    result.steps_recomputed += 1
                else:
                    wait = min(event.get("data_wait", 0.0), duration)
                    result.step_time += duration - wait
                    result.data_wait += wait
                    result.steps_kept += 1
                    result.kept_step_seconds.append(duration - wait)
            elif event["kind"] == EventKind.SAVE:
                result.save_stall += duration
                result.save_stalls.append(duration)
            elif event["kind"] == EventKind.DURABLE and event["step"] in save_started:
                result.durable_latencies.append(event["t"] - save_started[event["step"]])
            elif event["kind"] == EventKind.RESTORE:
                result.restore += duration
                restored += duration
            elif event["kind"] == EventKind.STEP_DISCARDED:
                result.wasted += duration
                result.steps_recomputed += 1
                reforming_since = event["t"]
            elif event["kind"] == EventKind.PEER_RECOVERY:
                result.restore += duration
                copying += duration if reforming_since is not None else 0.0
            elif event["kind"] == EventKind.MEMBERSHIP:
                result.failures += len(event["lost"])
        result.starts.append(setup + restored)
        if index + 1 < len(attempts) and not attempt.finished and not attempts[index + 1].took_over:
            result.failures += 1
        boundary = attempt.end
    result.other = result.total - sum(getattr(result, part) for part in PARTS if part != "other")
    return result
