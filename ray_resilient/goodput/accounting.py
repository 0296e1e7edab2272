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

Each attempt's events fold into an :class:`AttemptSummary` (:func:`summarize`: its steps split by
the restores after it) and the breakdown adds up the summaries (:func:`account_summaries`), so
that the ledger can store an ended attempt's summary instead of having its events read again.

A step's time is from the previous mark of the loop (the end of the previous step's save, or of
the restore) to its ``step_completed``, so anything the loop does between steps (logging, a
validation pass) counts as part of the next step.
"""

from __future__ import annotations

import math
from array import array
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ray_resilient.goodput.events import EventKind

PARTS = ("productive", "slow_steps", "wasted", "data_wait", "save_stall", "restore", "hang", "init_restart", "other")
STEADY_STEPS = 20  # the length of the stretch whose median step is the reference
STEADY_STRIDE = 5  # stretches start every this many kept steps
WINDOWS_AT_ONCE = 1 << 16  # stretches whose medians numpy computes at once (memory: 20 floats each)
VALUES_AT_ONCE = 1 << 20  # kept steps whose slowness numpy sums at once
TIMELINE_BINS = 2000  # bins of the timeline over a run: each narrower than one of its pixels (see _binned)


def _stretch_medians(values: np.ndarray) -> np.ndarray:
    """The median of each stretch of ``STEADY_STEPS`` of ``values`` starting every ``STEADY_STRIDE``
    (empty when it is shorter than a stretch)."""
    if len(values) < STEADY_STEPS:
        return np.empty(0)
    return np.median(np.lib.stride_tricks.sliding_window_view(values, STEADY_STEPS)[::STEADY_STRIDE], axis=1)


class KeptSteps:
    """The seconds of a run's kept steps, in run order: its attempts' arrays as read (not copied),
    then the steps appended live."""

    def __init__(self, arrays: Sequence[np.ndarray] = ()):
        self._arrays = [a for a in arrays if len(a)]
        self._count = sum(map(len, self._arrays))
        self._live = array("d")

    def __len__(self) -> int:
        return self._count + len(self._live)

    def append(self, seconds: float) -> None:
        self._live.append(seconds)

    def values(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Steps ``start`` to ``stop`` (default: the last one), in one array."""
        stop = len(self) if stop is None else stop
        pieces, offset = [], 0
        for piece in (*self._arrays, np.asarray(self._live)):
            if offset < stop and start < offset + len(piece):
                pieces.append(piece[max(start - offset, 0):stop - offset])
            offset += len(piece)
        return np.concatenate(pieces) if pieces else np.empty(0)

    def stretch_medians(self, start: int) -> np.ndarray:
        """:func:`_stretch_medians` of the steps from ``start`` (a multiple of ``STEADY_STRIDE``),
        a bounded number of stretches at a time."""
        block = WINDOWS_AT_ONCE * STEADY_STRIDE
        return np.concatenate([_stretch_medians(self.values(first, first + block - STEADY_STRIDE + STEADY_STEPS))
                               for first in range(start, max(len(self), start + 1), block)])

    def beyond(self, start: int, reference: float) -> float:
        """The seconds the steps from ``start`` take beyond ``reference``, a bounded number at a time."""
        return float(sum(np.maximum(self.values(first, first + VALUES_AT_ONCE) - reference, 0.0).sum()
                         for first in range(start, len(self), VALUES_AT_ONCE)))


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
class AttemptSummary:
    """Everything the accounting, ``status`` and the report read from an attempt's events, its steps
    split at ``lost_after`` (the step above which a later attempt computed them again; None: every
    step kept). The ledger stores one per ended attempt (:mod:`~ray_resilient.goodput.ledger`)."""

    process: str
    start: float
    end: float
    first_work: float  # see Attempt.first_work
    restored_step: int | None
    finished: bool
    took_over: bool
    world_size: int | None  # its workers (a lead that took over: its first replicas); None: not recorded
    step_range: tuple[int, int] | None  # its lowest and highest completed step (None: no step)
    lost_after: int | None
    step_time: float = 0.0  # kept steps less their data wait
    data_wait: float = 0.0
    wasted: float = 0.0
    save_stall: float = 0.0
    restore: float = 0.0  # restores and survivor mode's state copies
    start_restore: float = 0.0  # its restore from storage, a part of its start's cost
    reforming: float = 0.0  # survivor mode: re-forming the group after a dropped step
    steps_kept: int = 0
    steps_recomputed: int = 0
    replicas_lost: int = 0
    kept_step_seconds: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False)
    save_stalls: list[float] = field(default_factory=list, repr=False)
    durable_latencies: list[float] = field(default_factory=list, repr=False)
    # Each durable save's write: the kept steps that ran beside it, and their seconds less data wait.
    write_windows: list[tuple[int, float]] = field(default_factory=list, repr=False)
    registered: list[int] = field(default_factory=list, repr=False)  # steps of checkpoints Ray was told of
    errors: list[tuple[float, str]] = field(default_factory=list, repr=False)  # its failures: (time, error)
    bars: dict[str, list[tuple[float, float]]] = field(default_factory=dict, repr=False)  # timeline: (start, s)
    marks: dict[str, list[float]] = field(default_factory=dict, repr=False)  # timeline: kind -> times

    @property
    def last_step(self) -> int | None:
        return None if self.step_range is None else self.step_range[1]

    def splits_alike(self, lost_after: int | None) -> bool:
        """Whether ``lost_after`` splits its steps into kept and recomputed as its own does."""
        if self.step_range is None:
            return True
        return _split(lost_after, *self.step_range) == _split(self.lost_after, *self.step_range)


def _split(lost_after: int | None, low: int, high: int) -> int | str:
    """How ``lost_after`` splits steps ``low`` to ``high``: all kept, all lost, or at itself."""
    if lost_after is None or lost_after >= high:
        return "kept"
    return "lost" if lost_after < low else lost_after


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
    kept_step_seconds: KeptSteps = field(default_factory=KeptSteps, repr=False)
    save_stalls: list[float] = field(default_factory=list, repr=False)
    durable_latencies: list[float] = field(default_factory=list, repr=False)  # each save's start to durable
    write_windows: list[tuple[int, float]] = field(default_factory=list, repr=False)  # see AttemptSummary
    starts: list[float] = field(default_factory=list, repr=False)  # each attempt's init_restart + restore
    given_reference: float | None = None  # a reference step time passed by the caller
    _slow: tuple[int, float | None, float] = field(default=(0, None, 0.0), repr=False, compare=False)

    def _slow_steps(self) -> tuple[float | None, float]:
        """(reference step time, slow steps' seconds), brought up to date with the steps kept since
        last asked: only their stretches and seconds are read, unless the reference fell."""
        kept = self.kept_step_seconds
        count, (seen, reference, slow) = len(kept), self._slow
        if count == seen and count:
            return reference, slow
        if self.given_reference:
            latest = self.given_reference
        elif count <= STEADY_STEPS:  # a short run: the median of all its steps
            latest = float(np.median(kept.values())) if count else None
        else:  # the lowest median of a stretch: of those not seen yet (all, the first time) and the last one
            first = (seen - STEADY_STEPS) // STEADY_STRIDE * STEADY_STRIDE + STEADY_STRIDE if seen > STEADY_STEPS else 0
            latest = float(kept.stretch_medians(first).min(initial=reference if first else np.inf))
        if not latest:
            slow = 0.0
        elif latest == reference and seen:
            slow += kept.beyond(seen, latest)
        else:
            slow = kept.beyond(0, latest)
        self._slow = (count, latest, slow)
        return latest, slow

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
    def save_interference(self) -> list[float]:
        """What each durable save cost the steps that ran beside its write: their seconds beyond
        the reference step time (a save's write competes with them for the host's memory
        bandwidth, CPU and network), the save's cost besides its stall."""
        reference = self.reference_step_seconds
        if reference is None:
            return []
        return [max(0.0, seconds - steps * reference) for steps, seconds in self.write_windows]

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
        scalars = {f.name: value for f in fields(self)
                   if f.name != "given_reference" and isinstance(value := getattr(self, f.name), (int, float))}
        return scalars | {"productive": self.productive, "slow_steps": self.slow_steps,
                         "reference_step_seconds": self.reference_step_seconds, "goodput": self.goodput}


def group_attempts(events: Iterable[Mapping[str, Any]]) -> tuple[list[Attempt], list[float]]:
    """Rank 0's events grouped into attempts (in start order), and the drivers' start times."""
    by_process: dict[str, list[dict[str, Any]]] = {}
    job_starts = []
    for event in events:
        if event["kind"] == EventKind.JOB_START:
            job_starts.append(event["t"])
        elif event.get("rank", 0) == 0:
            by_process.setdefault(event["process"], []).append(event)
    attempts = [Attempt(p, sorted(evs, key=lambda e: e["t"])) for p, evs in by_process.items()]
    return sorted(attempts, key=lambda a: a.start), sorted(job_starts)


def lost_after_each(restored_steps: Sequence[int | None]) -> list[int | None]:
    """For each attempt (in start order, given the step each restored, None: it died before), the
    step above which its steps were computed again by a later attempt (None: every step kept)."""
    lowest: int | None = None
    found = []
    for restored in reversed(restored_steps):
        found.append(lowest)
        if restored is not None:
            lowest = restored if lowest is None else min(lowest, restored)
    return found[::-1]


def summarize(attempt: Attempt, lost_after: int | None, run_start: float) -> AttemptSummary:
    """Fold ``attempt``'s events into its summary, its steps above ``lost_after`` recomputed, its
    timeline's bars binned when there are more of them than bins (see :func:`_binned`) in its share
    of the run so far (from ``run_start``)."""
    events = attempt.events
    steps = [e["step"] for e in events if e["kind"] == EventKind.STEP]
    sized = next((e for e in events if e["kind"] in (EventKind.ATTEMPT_START, EventKind.MEMBERSHIP)), {})
    summary = AttemptSummary(attempt.process, attempt.start, attempt.end, attempt.first_work(), attempt.restored_step,
                             attempt.finished, attempt.took_over, sized.get("world_size"),
                             (min(steps), max(steps)) if steps else None, lost_after)
    # A save's durable event may come before the save's own (the writer's thread records it).
    saves = {e["step"]: (e["t_start"], e["t"]) for e in events if e["kind"] == EventKind.SAVE}  # its stall
    writes: list[tuple[float, float]] = []  # each durable save's write: (its stall's end, durable)
    kept: list[float] = []
    kept_spans: list[tuple[float, float]] = []
    bars: dict[str, list[tuple[float, float]]] = defaultdict(list)
    marks: dict[str, list[float]] = defaultdict(list)
    reforming_since, copying = None, 0.0  # survivor mode: since a step was dropped
    for event in events:
        kind, t0 = event["kind"], event.get("t_start", event["t"])
        duration = event["t"] - t0
        if kind == EventKind.STEP and reforming_since is not None:
            summary.reforming += max(0.0, t0 - reforming_since - copying)
            reforming_since, copying = None, 0.0
        if kind == EventKind.STEP and lost_after is not None and event["step"] > lost_after:
            summary.wasted += duration
            summary.steps_recomputed += 1
            bars["wasted"].append((t0, duration))
        elif kind == EventKind.STEP:
            wait = min(event.get("data_wait", 0.0), duration)
            summary.step_time += duration - wait
            summary.data_wait += wait
            summary.steps_kept += 1
            kept.append(duration - wait)
            kept_spans.append((t0, event["t"]))
            if wait > 0:
                bars["data_wait"].append((t0, wait))
            bars["kept"].append((t0 + wait, duration - wait))
        elif kind == EventKind.SAVE:
            summary.save_stall += duration
            summary.save_stalls.append(duration)
            bars["save"].append((t0, duration))
        elif kind in (EventKind.DURABLE, EventKind.REGISTERED):
            marks[EventKind(kind).value].append(t0)
            if kind == EventKind.REGISTERED:
                summary.registered.append(event["step"])
            elif event["step"] in saves:
                stall_start, stall_end = saves[event["step"]]
                summary.durable_latencies.append(event["t"] - stall_start)
                writes.append((stall_end, event["t"]))
        elif kind == EventKind.RESTORE:
            summary.restore += duration
            summary.start_restore += duration
            bars["restore"].append((t0, duration))
        elif kind == EventKind.STEP_DISCARDED:
            summary.wasted += duration
            summary.steps_recomputed += 1
            reforming_since = event["t"]
            bars["wasted"].append((t0, duration))
        elif kind == EventKind.PEER_RECOVERY:
            summary.restore += duration
            copying += duration if reforming_since is not None else 0.0
            bars["restore"].append((t0, duration))
        elif kind == EventKind.MEMBERSHIP:
            summary.replicas_lost += len(event["lost"])
            marks["membership"].append(t0)
        elif kind == EventKind.FAILURE:
            summary.errors.append((event["t"], event.get("error", "")))
    summary.kept_step_seconds = np.array(kept, dtype=float)
    summary.write_windows = _beside(writes, kept_spans, summary.kept_step_seconds)
    share = (summary.end - summary.start) / (summary.end - run_start) if summary.end > run_start else 1.0
    bins = max(1, math.ceil(TIMELINE_BINS * share))
    many = sum(len(spans) for spans in bars.values()) > bins
    summary.bars = _binned(bars, summary.start, summary.end, bins) if many else dict(bars)
    summary.marks = dict(marks)
    return summary


def _beside(writes: list[tuple[float, float]], spans: list[tuple[float, float]],
            seconds: np.ndarray) -> list[tuple[int, float]]:
    """For each write (from, to), the kept steps whose span (start, end; in order, not overlapping)
    overlaps it, and their ``seconds``."""
    if not writes or not spans:
        return [(0, 0.0) for _ in writes]
    starts, ends = np.array(spans, dtype=float).T
    before = np.concatenate([[0.0], np.cumsum(seconds)])
    windows = []
    for begin, end in writes:
        first = int(np.searchsorted(ends, begin, side="right"))  # the first step ending after the write began
        stop = int(np.searchsorted(starts, end, side="left"))  # past the last step begun before it ended
        windows.append((max(0, stop - first), float(before[max(first, stop)] - before[first])))
    return windows


def _binned(bars: Mapping[str, list[tuple[float, float]]], start: float, end: float,
            bins: int) -> dict[str, list[tuple[float, float]]]:
    """``bars`` (of each kind, not overlapping) as ``bins`` equal bins of [start, end]: in each, the
    seconds of each kind in it, side by side. A bin is narrower than a pixel of the timeline (it
    spans the run at least up to ``end`` in ``TIMELINE_BINS`` bins), whose pixels show the same mix
    of colours."""
    edges = np.linspace(start, end, bins + 1)
    filled = np.zeros(bins)
    binned = {}
    for kind, spans in bars.items():
        covered = np.diff(_covered_before(spans, edges))
        binned[kind] = [(float(edges[i] + filled[i]), float(covered[i])) for i in np.flatnonzero(covered > 0)]
        filled += covered
    return binned


def _covered_before(spans: list[tuple[float, float]], edges: np.ndarray) -> np.ndarray:
    """The seconds ``spans`` (start, seconds; not overlapping) cover before each of ``edges``."""
    starts, seconds = np.array(sorted(spans), dtype=float).T
    seconds = np.maximum(seconds, 0.0)
    before = np.concatenate([[0.0], np.cumsum(seconds)])
    begun = np.searchsorted(starts, edges, side="right")  # spans starting at or before each edge
    last = np.maximum(begun - 1, 0)
    beyond = np.where(begun > 0, np.maximum(starts[last] + seconds[last] - edges, 0.0), 0.0)
    return before[begun] - beyond


def account(events: Iterable[Mapping[str, Any]], now: float | None = None,
            reference_step_seconds: float | None = None) -> Breakdown:
    """The breakdown of a run's wall time from its events (up to ``now``, default the last event);
    slow steps measured against ``reference_step_seconds`` (default: the run's own)."""
    events = list(events)
    attempts, job_starts = group_attempts(events)
    hangs = [(e["t_start"], e["t"]) for e in events if e["kind"] == EventKind.HANG]
    run_start = min([a.start for a in attempts[:1]] + job_starts, default=0.0)
    lost = lost_after_each([a.restored_step for a in attempts])
    summaries = [summarize(attempt, after, run_start) for attempt, after in zip(attempts, lost)]
    return account_summaries(summaries, job_starts, hangs, now, reference_step_seconds)


def account_summaries(attempts: Sequence[AttemptSummary], job_starts: Sequence[float],
                      hangs: Sequence[tuple[float, float]], now: float | None = None,
                      reference_step_seconds: float | None = None) -> Breakdown:
    """:func:`account` from the run's attempts' summaries (in start order), its drivers' starts and
    its hangs (each from the hung rank's last progress to the watchdog's declaration)."""
    if reference_step_seconds is not None and not reference_step_seconds > 0:
        raise ValueError(f"reference_step_seconds must be > 0, got {reference_step_seconds!r}")
    result = Breakdown(given_reference=reference_step_seconds,
                       kept_step_seconds=KeptSteps([a.kept_step_seconds for a in attempts]))
    if not attempts:
        return result
    start = min([attempts[0].start, *job_starts])
    end = max(a.end for a in attempts) if now is None else now
    result.total = end - start
    result.attempts = len(attempts)
    result.hang = sum(max(0.0, min(t, end) - max(t_start, start)) for t_start, t in hangs)
    boundary = start
    for index, attempt in enumerate(attempts):
        setup = max(0.0, attempt.first_work - boundary)
        hung = sum(max(0.0, min(t, attempt.first_work) - max(t_start, boundary)) for t_start, t in hangs)
        result.init_restart += max(0.0, setup - hung) + attempt.reforming  # a hang that ran into the gap is its
        for part in ("step_time", "data_wait", "wasted", "save_stall", "restore", "steps_kept", "steps_recomputed"):
            setattr(result, part, getattr(result, part) + getattr(attempt, part))
        result.failures += attempt.replicas_lost
        result.save_stalls += attempt.save_stalls
        result.durable_latencies += attempt.durable_latencies
        result.write_windows += attempt.write_windows
        result.starts.append(setup + attempt.start_restore)
        if index + 1 < len(attempts) and not attempt.finished and not attempts[index + 1].took_over:
            result.failures += 1
        boundary = attempt.end
    result.other = result.total - sum(getattr(result, part) for part in PARTS if part != "other")
    return result
