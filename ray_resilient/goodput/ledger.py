"""The goodput ledger: an append-only event log of a run in its storage, across restarts and drivers.

Each process that records writes its own file, ``<run dir>/goodput/<process>.jsonl`` (the process
id ``<start ns>-rank<r>-<pid>``), one JSON event per line with its wall-clock time ``t``
(``time.time()``, comparable across the nodes of a cluster with synchronized clocks), ``kind``
(an :class:`~ray_resilient.goodput.events.EventKind`), ``process`` and ``rank``. Files are never
rewritten, so nothing another attempt or driver wrote is lost. Rank 0 records the run's progress;
other ranks only add what rank 0 cannot know (their own failures).

Writing costs the loop one ``write`` system call per event: on local or mounted storage the file is
appended in place (so a SIGKILL loses nothing); on remote storage (S3, GCS) events go to a local
spool file and a background thread uploads what is new every ``upload_seconds`` (2) as an object
named by the spool's byte range (objects cannot be appended to), so a killed process loses at most
that much of its log. An upload never holds up ``record``: it reads what the spool held when it
began, without the lock ``record`` takes. A write that fails (a full disk) loses its event, counted
in ``LedgerWriter.spool_errors``; recording never fails the loop.

A long run must not make recovery slower (every restore reads the ledger): uploads are compacted
like a counter in base :data:`FAN_IN`. When the newest ``FAN_IN`` objects of a process cover ranges
of the same size class, one object covering their union is uploaded and they are deleted, so a
process keeps at most ``FAN_IN`` objects per size class: about 60 for a day of uploads every 2 s
instead of 43,000. A reader takes, per process, the objects that cover its spool without overlap
(an object whose range lies inside another's, left by a crash between a merge and its deletes, is
not read), and reads them in parallel.

Nor may a long run's events: each ended attempt is folded once into a summary
(:class:`~ray_resilient.goodput.accounting.AttemptSummary`: what the accounting, ``status`` and the
report read from its events), stored as ``<process>.summary`` by the rank 0 of a later attempt
when it reads the ledger (at its restore, or a survivor-mode lead taking over). Readers (restores,
lead changes, ``status``, ``goodput report``: :func:`read_ledger`) read the summaries and the
events of the attempts without one (the open one, those ended since); the events of a summarized
attempt are known by their names (``<process>.jsonl...``) and skipped unread, but kept for
debugging (:func:`read_events` reads them all). A summary splits its steps into kept and recomputed
as the restores known when it was folded said; when a later restore goes back further, readers
fold its events again (and the next restore stores that summary). Events a process adds after its
summary is stored (a rank 0 still being torn down) are not read. A summary is one line of JSON
(``format``, its fields, ``kept_bytes``) followed by its kept steps' seconds as little-endian
float64: 8 bytes a step, which the steady reference and the slow steps are computed from exactly.

A run directory is shared and sometimes messy: a file in ``goodput/`` that is not a process's log
(an editor's swap file, ``.DS_Store``), bytes that are not text, a line that is not an event (torn
by a kill, or without a time or kind), a summary that cannot be read (its events are read instead)
are skipped, each with a warning naming it. Reading the ledger never fails a restore.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from ray_resilient.goodput.accounting import (
    AttemptSummary, Breakdown, account_summaries, group_attempts, lost_after_each, summarize,
)
from ray_resilient.goodput.events import REQUIRED_FIELDS, EventKind
from ray_resilient.storage.run import RunStorage

logger = logging.getLogger(__name__)

LEDGER_DIR = "goodput"
FAN_IN = 16  # a process's newest objects of one size class merged into one of the next
READ_THREADS = 16
_PROCESS = r"\d+-rank-?\d+-\d+"  # LedgerWriter.process
_PROCESS_RE = re.compile(f"^{_PROCESS}$")
_PROCESS_LOG = f"{_PROCESS}\\.jsonl"
_LOG_RE = re.compile(f"^{_PROCESS_LOG}$")
_RANGE_RE = re.compile(f"^(?P<process>{_PROCESS_LOG})\\.(?P<start>\\d{{12}})-(?P<end>\\d{{12}})$")
_SUMMARY = ".summary"  # <process>.summary: an ended attempt's AttemptSummary
_SUMMARY_RE = re.compile(f"^(?P<process>{_PROCESS})\\{_SUMMARY}$")
SUMMARY_FORMAT = 1  # of a stored summary (see the module docstring)
_NUMBERS = [f.name for f in fields(AttemptSummary) if f.type in ("float", "int")]  # a summary's, checked when read


def ledger_path(experiment_path: str) -> str:
    return f"{experiment_path}/{LEDGER_DIR}"


class LedgerWriter:
    """Appends this process's events to its file in the run's ledger."""

    def __init__(self, storage: RunStorage, rank: int, upload_seconds: float = 2.0):
        self.rank = rank
        self.process = f"{time.time_ns()}-rank{rank}-{os.getpid()}"
        self._filesystem, self._directory = storage.filesystem, ledger_path(storage.experiment_path)
        self._remote = storage.is_remote
        self._filesystem.create_dir(self._directory)
        if self._remote:
            self._path = os.path.join(storage.local_dir, f"ledger-{self.process}.jsonl")
        else:
            self._path = f"{self._directory}/{self.process}.jsonl"
        self._fd: int | None = None  # the spool: opened now, so that each process's file exists from its start
        self._size = 0  # the spool's bytes of whole events
        self.spool_errors = 0  # events lost: the spool could not be written (a full disk)
        self._lock = threading.Lock()  # the spool file, for record()
        self._upload_lock = threading.Lock()  # one upload at a time (the thread, flush(), close())
        self._uploaded = 0
        self._objects: list[tuple[int, int, int]] = []  # uploaded (start, end, size class), oldest first
        self._stop = threading.Event()
        self._uploader = None
        with contextlib.suppress(OSError):  # a full disk: opened at the first record, or its loss counted
            self._open()
        if self._remote:
            self._uploader = threading.Thread(target=self._upload_every, args=(upload_seconds,), daemon=True,
                                              name="ray_resilient_ledger_upload")
            self._uploader.start()

    def record(self, kind: EventKind, t: float | None = None, **fields: Any) -> dict[str, Any]:
        """Append one event (time ``t``, default now); returns it. An event the spool cannot take (a
        full disk: any ``OSError``) is lost, not retried: it is counted in :attr:`spool_errors` and
        warned about (at the 1st, 2nd, 4th, 8th... loss), and the caller's training goes on."""
        event = {"t": time.time() if t is None else t, "kind": EventKind(kind).value, "process": self.process,
                 "rank": self.rank, **fields}
        line = (json.dumps(event) + "\n").encode()
        with self._lock:
            try:
                self._append(line)
            except OSError as err:
                self._lost(err)
        return event

    def _append(self, line: bytes) -> None:
        """Write ``line`` at the spool's end; a part of it written before an error is cut off again."""
        if self._fd is None:
            self._open()
        try:
            written = 0
            while written < len(line):
                written += os.write(self._fd, line[written:])
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)  # else the torn line is skipped by readers
            raise
        self._size = os.lseek(self._fd, 0, os.SEEK_CUR)

    def _open(self) -> None:
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _lost(self, error: OSError) -> None:
        self.spool_errors += 1
        if self.spool_errors & (self.spool_errors - 1) == 0:
            logger.warning("The goodput ledger lost an event: its spool %s cannot be written (%s); %d lost so far, "
                           "training goes on", self._path, error, self.spool_errors)

    def flush(self) -> None:
        """Make every event recorded so far visible to :func:`read_events` (uploads on remote storage)."""
        if self._remote:
            self._upload_new()

    def _upload_every(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            self._upload_new()

    def _upload_new(self) -> None:
        with self._upload_lock:
            with self._lock:
                end = self._size  # every event recorded so far is written up to here
            if end <= self._uploaded:
                return
            try:
                self._put(self._uploaded, end, 0)
                self._uploaded = end
                self._compact()
            except OSError as err:  # retried with the next upload; the ledger must not stop training
                logger.warning("goodput ledger upload failed (%s); retrying later", err)

    def _object_path(self, start: int, end: int) -> str:
        return f"{self._directory}/{self.process}.jsonl.{start:012d}-{end:012d}"

    def _put(self, start: int, end: int, size_class: int) -> None:
        """Upload the spool's bytes [start, end) as one object."""
        with open(self._path, "rb") as spool:
            spool.seek(start)
            data = spool.read(end - start)
        with self._filesystem.open_output_stream(self._object_path(start, end)) as out:
            out.write(data)
        self._objects.append((start, end, size_class))

    def _compact(self) -> None:
        """While the newest FAN_IN objects share a size class, replace them by one of the next."""
        while len(self._objects) >= FAN_IN and len({c for _, _, c in self._objects[-FAN_IN:]}) == 1:
            merged = self._objects[-FAN_IN:]
            del self._objects[-FAN_IN:]
            try:
                self._put(merged[0][0], merged[-1][1], merged[0][2] + 1)
            except OSError:
                self._objects += merged  # kept as they are; merged at a later upload
                raise
            for start, end, _ in merged:  # a crash before these deletes leaves ranges the reader skips
                self._filesystem.delete_file(self._object_path(start, end))

    def close(self) -> None:
        if self._uploader is not None:
            self._stop.set()
            self._uploader.join()
            self._upload_new()
        if self._fd is not None:
            os.close(self._fd)


def read_events(filesystem: pafs.FileSystem, experiment_path: str) -> list[dict[str, Any]]:
    """Every event of the run's ledger, in time order (empty if it has none): the summarized
    attempts' too, for debugging; :func:`read_ledger` is what the accounting reads."""
    logs, _ = _ledger_files(filesystem, experiment_path)
    return sorted(_read_logs(filesystem, _covering(logs)), key=lambda e: e["t"])


@dataclass
class Ledger:
    """A run's ledger as its readers need it: each attempt summarized, and the other processes' events."""

    attempts: list[AttemptSummary]  # rank 0's, in start order
    job_starts: list[float]
    hangs: list[dict[str, Any]]  # the hang watchdog's events, in time order
    failures: list[tuple[float, str]]  # every rank's (time, error), in time order
    folded: list[AttemptSummary]  # the attempts this read summarized from their events (no summary was stored)

    def account(self, now: float | None = None, reference_step_seconds: float | None = None) -> Breakdown:
        """The run's :func:`~ray_resilient.goodput.accounting.account`."""
        hangs = [(h["t_start"], h["t"]) for h in self.hangs]
        return account_summaries(self.attempts, self.job_starts, hangs, now, reference_step_seconds)


def read_ledger(filesystem: pafs.FileSystem, experiment_path: str) -> Ledger:
    """The run's ledger (empty if it has none): each ended attempt's stored summary where one is
    stored, without reading its events, and the events of the others (see the module docstring)."""
    logs, summary_paths = _ledger_files(filesystem, experiment_path)
    stored = _read_summaries(filesystem, summary_paths)
    events = _read_logs(filesystem, _covering([p for p in logs if _process_of(p) not in stored]))
    attempts, job_starts = group_attempts(events)
    ordered = sorted([*stored.values(), *(a for a in attempts if a.process not in stored)], key=lambda a: a.start)
    lost = dict(zip((a.process for a in ordered), lost_after_each([a.restored_step for a in ordered])))
    stale = {p for p, summary in stored.items() if not summary.splits_alike(lost[p])}
    if stale:  # a later attempt restored an older step than the one their summaries assumed
        logger.info("Reading the events of %d summarized attempts again: a restore recomputed their steps", len(stale))
        events += _read_logs(filesystem, _covering([p for p in logs if _process_of(p) in stale]))
        attempts, job_starts = group_attempts(events)
        stored = {p: summary for p, summary in stored.items() if p not in stale}
    run_start = min([a.start for a in ordered[:1]] + job_starts, default=0.0)
    folded = [summarize(a, lost[a.process], run_start) for a in attempts if a.process not in stored]
    summaries = sorted([*stored.values(), *folded], key=lambda a: a.start)
    others = [e for e in events if e.get("rank", 0) != 0]
    failures = [*(error for a in summaries for error in a.errors),
                *((e["t"], e.get("error", "")) for e in others if e["kind"] == EventKind.FAILURE)]
    hangs = sorted((e for e in events if e["kind"] == EventKind.HANG), key=lambda e: e["t"])
    return Ledger(summaries, job_starts, hangs, sorted(failures), folded)


def load_ledger(run_dir: str) -> Ledger:
    """The ledger of the run at ``run_dir`` (a path or URI); ValueError for a run without a ledger."""
    storage = RunStorage.from_uri(run_dir)
    ledger = read_ledger(storage.filesystem, storage.experiment_path)
    if not ledger.attempts:
        raise _no_ledger(run_dir, storage)
    return ledger


def store_summaries(filesystem: pafs.FileSystem, experiment_path: str, summaries: list[AttemptSummary]) -> None:
    """Store the summaries of ended attempts, so that readers skip their events."""
    for summary in summaries:
        if _PROCESS_RE.match(summary.process):  # a name from a ledger line: only a process id makes a file name
            with filesystem.open_output_stream(f"{ledger_path(experiment_path)}/{summary.process}{_SUMMARY}") as out:
                out.write(_summary_bytes(summary))


def _summary_bytes(summary: AttemptSummary) -> bytes:
    """One line of JSON (every field but the kept steps' seconds, and their byte count), then those
    seconds as little-endian float64."""
    kept = np.ascontiguousarray(summary.kept_step_seconds, dtype="<f8")
    header = {f.name: getattr(summary, f.name) for f in fields(summary) if f.name != "kept_step_seconds"}
    return json.dumps({"format": SUMMARY_FORMAT, "kept_bytes": kept.nbytes, **header}).encode() + b"\n" + kept.tobytes()


def _parse_summary(data: bytes) -> AttemptSummary | None:
    """The summary stored as ``data``; None when it is not one (torn by a kill, another format, a
    field that is not what it says)."""
    header_end = data.find(b"\n")
    try:
        header = json.loads(data[:header_end])
        if header.pop("format") != SUMMARY_FORMAT or header.pop("kept_bytes") != len(data) - header_end - 1:
            return None
        summary = AttemptSummary(**header, kept_step_seconds=np.frombuffer(data, dtype="<f8", offset=header_end + 1))
        summary.step_range = None if summary.step_range is None else (int(summary.step_range[0]),
                                                                        int(summary.step_range[1]))
        summary.errors = [(t, str(error)) for t, error in summary.errors]
        summary.write_windows = [(int(steps), seconds) for steps, seconds in summary.write_windows]
        return summary if _well_formed(summary) else None
    except (ValueError, TypeError, KeyError, AttributeError):  # JSONDecodeError is a ValueError
        return None


def _well_formed(summary: AttemptSummary) -> bool:
    """Whether every number of ``summary`` is a finite one, each step an integer or None, and each
    timeline bar a (start, seconds) pair (a ValueError when one is not)."""
    numbers = [*(getattr(summary, name) for name in _NUMBERS), *summary.save_stalls, *summary.durable_latencies,
               *(t for t, _ in summary.errors), *(seconds for _, seconds in summary.write_windows)]
    steps = [summary.restored_step, summary.lost_after, summary.world_size, *summary.registered]
    bars = [np.asarray(spans, dtype=float).reshape(len(spans), 2) for spans in summary.bars.values()]
    marks = [np.asarray(times, dtype=float).reshape(len(times)) for times in summary.marks.values()]
    return (all(map(_finite, numbers)) and all(s is None or isinstance(s, int) for s in steps)
            and all(np.isfinite(a).all() for a in [summary.kept_step_seconds, *bars, *marks]))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_summaries(filesystem: pafs.FileSystem, paths: dict[str, str]) -> dict[str, AttemptSummary]:
    """Process -> its stored summary, of ``paths`` (process -> path); one that cannot be read is
    skipped with a warning (its attempt's events are read instead)."""
    def read(path: str) -> AttemptSummary | None:
        with filesystem.open_input_stream(path) as stream:
            return _parse_summary(stream.read())

    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        found = dict(zip(paths, pool.map(read, paths.values())))
    for process in [p for p, summary in found.items() if summary is None or summary.process != p]:
        logger.warning("Skipping %s in the goodput ledger: not a summary (torn?); reading its events instead",
                       paths[process])
        del found[process]
    return found


def _ledger_files(filesystem: pafs.FileSystem, experiment_path: str) -> tuple[list[str], dict[str, str]]:
    """The ledger's files: every one but the summaries, and process -> its summary's path."""
    selector = pafs.FileSelector(ledger_path(experiment_path), allow_not_found=True)
    logs, summaries = [], {}
    for info in filesystem.get_file_info(selector):
        if info.type == pafs.FileType.File:
            match = _SUMMARY_RE.match(info.base_name)
            if match is None:
                logs.append(info.path)
            else:
                summaries[match["process"]] = info.path
    return logs, summaries


def _process_of(path: str) -> str:
    """The process whose log ``path`` is (a stray file: its name)."""
    name = path.rsplit("/", 1)[-1]
    return name.split(".jsonl", 1)[0]


def _read_logs(filesystem: pafs.FileSystem, paths: list[str]) -> list[dict[str, Any]]:
    """The events of the ledger files ``paths``, read in parallel."""
    def read(path: str) -> str | None:
        with filesystem.open_input_stream(path) as stream:
            data = stream.read()
        try:
            return data.decode()
        except UnicodeDecodeError:
            logger.warning("Skipping %s in the goodput ledger: it is not text", path)
            return None

    events = []
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        for path, text in zip(paths, pool.map(read, paths)):
            for line in (text or "").splitlines():
                if line.strip():
                    event = _parse_event(line)
                    if event is None:  # e.g. the last line of a process killed mid-write
                        logger.warning("Skipping a line of %s in the goodput ledger that is not an event: %.80r",
                                       path, line)
                    else:
                        events.append(event)
    return events


def _parse_event(line: str) -> dict[str, Any] | None:
    """The event of a ledger line; None when it is not one (a JSON object of a known kind, with a
    time, a process and the fields its kind carries, :data:`~.events.REQUIRED_FIELDS`, its numbers
    finite: JSON's ``Infinity`` and ``NaN`` parse, and would make every share ``nan``)."""
    try:
        event = json.loads(line)
        kind = EventKind(event["kind"])
    except (json.JSONDecodeError, TypeError, KeyError, ValueError):
        return None
    if not isinstance(event.get("process"), str):
        return None
    for field in ("t", *REQUIRED_FIELDS[kind]):
        value = event.get(field)
        expected = list if field == "lost" else (int, float)
        if not isinstance(value, expected) or isinstance(value, bool) or (
                expected is not list and not math.isfinite(value)):
            return None
    return event


def _covering(paths: list[str]) -> list[str]:
    """The ledger files to read: each process's uploaded ranges without overlap, and the files
    appended in place; any other file is skipped with a warning."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    chosen = []
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        match = _RANGE_RE.match(name)
        if match is None:
            if _LOG_RE.match(name):
                chosen.append(path)  # a file appended in place (local storage)
            else:
                logger.warning("Skipping %s in the goodput ledger: not a process's log (a stray file?)", path)
        else:
            ranges.setdefault(match["process"], []).append((int(match["start"]), -int(match["end"]), path))
    for objects in ranges.values():
        covered = 0
        for start, negative_end, path in sorted(objects):  # widest first among equal starts
            if start >= covered:
                chosen.append(path)
                covered = -negative_end
    return sorted(chosen)


def load_events(run_dir: str) -> list[dict[str, Any]]:
    """Every ledger event of the run at ``run_dir`` (a path or URI); ValueError for a run without a ledger."""
    storage = RunStorage.from_uri(run_dir)
    events = read_events(storage.filesystem, storage.experiment_path)
    if not events:
        raise _no_ledger(run_dir, storage)
    return events


def _no_ledger(run_dir: str, storage: RunStorage) -> ValueError:
    return ValueError(f"{run_dir} has no goodput ledger ({ledger_path(storage.experiment_path)} is missing or empty): "
                      "pass the run directory <storage_path>/<run name> of a ray_resilient run")
