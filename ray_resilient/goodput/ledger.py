"""The goodput ledger: an append-only event log of a run in its storage, across restarts and drivers.

Each process that records writes its own file, ``<run dir>/goodput/<process>.jsonl`` (the process
id ``<start ns>-rank<r>-<pid>``), one JSON event per line with its wall-clock time ``t``
(``time.time()``, comparable across the nodes of a cluster with synchronized clocks), ``kind``
(an :class:`~ray_resilient.goodput.events.EventKind`), ``process`` and ``rank``. Files are never
rewritten, so nothing another attempt or driver wrote is lost. Rank 0 records the run's progress;
other ranks only add what rank 0 cannot know (their own failures).

Writing costs the loop one buffered ``write`` per event: on local or mounted storage the file is
appended in place (flushed every event, so a SIGKILL loses nothing); on remote storage (S3, GCS)
events go to a local spool file and a background thread uploads what is new every
``upload_seconds`` (2) as an object named by the spool's byte range (objects cannot be appended
to), so a killed process loses at most that much of its log. An upload never holds up ``record``:
it reads what the spool held when it began, without the lock ``record`` takes.

A long run must not make recovery slower (every restore reads the ledger): uploads are compacted
like a counter in base :data:`FAN_IN`. When the newest ``FAN_IN`` objects of a process cover ranges
of the same size class, one object covering their union is uploaded and they are deleted, so a
process keeps at most ``FAN_IN`` objects per size class: about 60 for a day of uploads every 2 s
instead of 43,000. A reader takes, per process, the objects that cover its spool without overlap
(an object whose range lies inside another's, left by a crash between a merge and its deletes, is
not read), and reads them in parallel.

A run directory is shared and sometimes messy: a file in ``goodput/`` that is not a process's log
(an editor's swap file, ``.DS_Store``), bytes that are not text, a line that is not an event (torn
by a kill, or without a time or kind) are skipped, each with a warning naming it. Reading the
ledger never fails a restore.
"""

from __future__ import annotations

import json
import math
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.fs as pafs

from ray_resilient.goodput.events import REQUIRED_FIELDS, EventKind
from ray_resilient.storage.run import RunStorage

logger = logging.getLogger(__name__)

LEDGER_DIR = "goodput"
FAN_IN = 16  # a process's newest objects of one size class merged into one of the next
READ_THREADS = 16
_PROCESS_LOG = r"\d+-rank-?\d+-\d+\.jsonl"  # LedgerWriter.process + ".jsonl"
_LOG_RE = re.compile(f"^{_PROCESS_LOG}$")
_RANGE_RE = re.compile(f"^(?P<process>{_PROCESS_LOG})\\.(?P<start>\\d{{12}})-(?P<end>\\d{{12}})$")


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
            os.makedirs(storage.local_dir, exist_ok=True)
            self._path = os.path.join(storage.local_dir, f"ledger-{self.process}.jsonl")
        else:
            self._path = f"{self._directory}/{self.process}.jsonl"
        self._file = open(self._path, "a")
        self._lock = threading.Lock()  # the spool file, for record()
        self._upload_lock = threading.Lock()  # one upload at a time (the thread, flush(), close())
        self._uploaded = 0
        self._objects: list[tuple[int, int, int]] = []  # uploaded (start, end, size class), oldest first
        self._stop = threading.Event()
        self._uploader = None
        if self._remote:
            self._uploader = threading.Thread(target=self._upload_every, args=(upload_seconds,), daemon=True,
                                              name="ray_resilient_ledger_upload")
            self._uploader.start()

    def record(self, kind: EventKind, t: float | None = None, **fields: Any) -> dict[str, Any]:
        """Append one event (time ``t``, default now); returns it."""
        event = {"t": time.time() if t is None else t, "kind": EventKind(kind).value, "process": self.process,
                 "rank": self.rank, **fields}
        with self._lock:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()
        return event

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
                end = self._file.tell()  # every event recorded so far is flushed up to here
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
        self._file.close()


def read_events(filesystem: pafs.FileSystem, experiment_path: str) -> list[dict[str, Any]]:
    """Every event of the run's ledger, in time order (empty if it has none)."""
    selector = pafs.FileSelector(ledger_path(experiment_path), allow_not_found=True)
    paths = _covering([i.path for i in filesystem.get_file_info(selector) if i.type == pafs.FileType.File])

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
    return sorted(events, key=lambda e: e["t"])


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
        raise ValueError(f"{run_dir} has no goodput ledger ({ledger_path(storage.experiment_path)} is missing or "
                         "empty): pass the run directory <storage_path>/<run name> of a ray_resilient run")
    return events
