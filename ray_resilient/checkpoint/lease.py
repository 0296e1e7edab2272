"""One writer per run: a lease on the run's directory, held by rank 0 of the run while it trains.

Two drivers started with the same run name and storage path would write the same checkpoint
directory names, and each one's cleanup would delete the other's saves in flight. So rank 0
takes a lease (``<run dir>/.lease``: Ray Train's run id, the holder, its renewal time) before it
lists or deletes anything, and renews it from a background thread. Ray Train's run id is the
same in every attempt of one ``trainer.fit()`` and new for every driver, so a restarted attempt
takes the lease straight back, and another driver's run finds it held and stops with
:class:`RunLeaseHeldError`, which names the holder.

Clocks of different machines disagree, so the times in another run's lease are never trusted:
a taker watches the lease file on its own monotonic clock, for the TTL its holder declared
(``expires - renewed``, a duration: the holder renews every sixth of it). A lease that changes
meanwhile (renewed) belongs to a live run; one left unchanged that long (its driver died) is
taken over.

On S3 every write of the lease is conditional (:mod:`ray_resilient.storage.conditional`): it
replaces only the version its writer read (or creates the file only if there is none), so of two
runs that take a dead run's lease at the same moment, or a taker and a renewal, one write fails
and its run stops. Other storage offers no compare-and-swap here, so there each taker reads the
lease back ``settle_s`` after writing it and only the one whose record is there goes on (the
other stops before it lists, writes or deletes anything); S3 takers do that too, for stores that
ignore the conditions. Every renewal reads the lease first, and a commit re-reads it
(:meth:`RunLease.verify`): a holder that finds another run's id there, or a lease file that does
not parse, has lost it (:class:`RunLeaseLostError`) and commits no further checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

import pyarrow.fs as pafs

from ray_resilient.checkpoint.errors import UnrecoverableRunError
from ray_resilient.storage.conditional import ChangedSinceRead, conditional_file
from ray_resilient.watchdog.progress import note_progress

logger = logging.getLogger(__name__)

LEASE_FILE = ".lease"
TTL_S = 30.0  # a lease not renewed for this long is taken over (its driver is gone)
RENEWALS_PER_TTL = 6  # the holder renews every ttl_s / 6 by default
SETTLE_S = 0.5  # a new holder reads its lease back this long after writing it
MAX_FOREIGN_TTL_S = 3600.0  # the longest another run's lease is watched, whatever TTL it declares


class RunLeaseHeldError(UnrecoverableRunError):
    """Another live run (another driver) holds the run directory."""


class RunLeaseLostError(UnrecoverableRunError):
    """Another run took over this run's directory while it trained (or its lease was destroyed)."""


@dataclass(frozen=True)
class LeaseRecord:
    """The content of the lease file (its times are the holder's clock: for people, not for expiry)."""

    run_id: str
    holder: str  # host and process of the holding rank 0
    renewed: float  # the holder's wall-clock time of the last renewal
    expires: float

    def describe(self) -> str:
        return f"Ray Train run {self.run_id} ({self.holder})"

    @property
    def ttl_s(self) -> float:
        """The TTL its holder declared (how long it may go unrenewed)."""
        return self.expires - self.renewed


def parse_lease(data: bytes) -> LeaseRecord | None:
    """The record in a lease file's bytes; None when they are not one."""
    try:
        fields = json.loads(data)
        record = LeaseRecord(**fields)
    except (ValueError, TypeError):
        return None
    if not (isinstance(record.run_id, str) and isinstance(record.holder, str)
            and all(isinstance(t, (int, float)) for t in (record.renewed, record.expires))):
        return None
    return record


class RunLease:
    """The lease of ``run_id`` on the run directory ``experiment_path`` (see the module docstring)."""

    def __init__(self, filesystem: pafs.FileSystem, experiment_path: str, run_id: str, *,
                 ttl_s: float = TTL_S, renew_every_s: float | None = None, settle_s: float = SETTLE_S,
                 clock: Callable[[], float] = time.time):
        if renew_every_s is None:
            renew_every_s = ttl_s / RENEWALS_PER_TTL
        if not 0 < renew_every_s < ttl_s:
            raise ValueError(f"the lease needs 0 < renew_every_s < ttl_s, got {renew_every_s}, {ttl_s}")
        self.filesystem = filesystem
        self.path = f"{experiment_path}/{LEASE_FILE}"
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.renew_every_s = renew_every_s
        self.settle_s = settle_s
        self.holder = f"host {socket.gethostname()} pid {os.getpid()}"
        self.lost: str | None = None  # why this holder lost the lease
        self._conditional = conditional_file(filesystem, self.path)  # None: storage without conditional writes
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this object took the lease and keeps renewing it."""
        return self._thread is not None

    def acquire(self) -> None:
        """Take the lease, and keep renewing it until :meth:`release`.

        Another run's lease is watched for the TTL its holder declared (a file that does not parse,
        for ``ttl_s``): renewed meanwhile, :class:`RunLeaseHeldError`; unchanged or removed, it is
        taken over. A taker that finds another run's record on reading its own back also gets
        :class:`RunLeaseHeldError`.
        """
        found, version = self._read_versioned()
        record = parse_lease(found) if found is not None else None
        if found is None or record is None or record.run_id != self.run_id:
            if found is not None:
                watch_s = self._ttl_of(record)
                logger.warning("The run directory is leased by %s; watching it for %.0fs to see whether it is "
                               "renewed", record.describe() if record else "an unreadable lease file", watch_s)
                if self._watch(found, watch_s):
                    logger.warning("Taking over the lease of %s: not renewed for %.0fs, its driver is gone",
                                   record.describe() if record else "an unreadable lease file", watch_s)
                else:  # removed, or retaken by this run
                    version = self._read_versioned()[1]
            self._write_or_held(version)
            self._stop.wait(self.settle_s)  # a taker writing at the same moment: the last write stands
            current = self.read_record()
            if current is None or current.run_id != self.run_id:
                raise self._held_error(current)
        else:
            self._write_or_held(version)
        self._thread = threading.Thread(target=self._renew, name="ray_resilient_lease", daemon=True)
        self._thread.start()

    def _ttl_of(self, record: LeaseRecord | None) -> float:
        """How long ``record``'s holder may go unrenewed: the TTL it declared (at most
        :data:`MAX_FOREIGN_TTL_S`, or this lease's if longer), else this lease's."""
        if record is None or not record.ttl_s > 0:
            return self.ttl_s
        cap = max(MAX_FOREIGN_TTL_S, self.ttl_s)
        if not record.ttl_s <= cap:  # inf and nan too
            logger.warning("The lease of %s declares a TTL of %s s; watching it for at most %.0f s",
                           record.describe(), record.ttl_s, cap)
            return cap
        return record.ttl_s

    def _watch(self, found: bytes, watch_s: float) -> bool:
        """Watch the lease file, holding ``found``, for ``watch_s`` on this machine's monotonic clock:
        True when unchanged that long (to be taken over), False when removed or retaken by this run;
        :class:`RunLeaseHeldError` as soon as another run renews it."""
        deadline = time.monotonic() + watch_s
        while (left := deadline - time.monotonic()) > 0:
            self._stop.wait(min(self.renew_every_s / 4, left))
            note_progress()  # a wait bounded by the watched lease's TTL, not a hang
            current = self._read_bytes()
            if current is None:
                return False
            if current != found:
                record = parse_lease(current)
                if record is not None and record.run_id == self.run_id:
                    return False
                raise self._held_error(record)
        return True

    def _held_error(self, record: LeaseRecord | None) -> RunLeaseHeldError:
        return RunLeaseHeldError(
            f"the run directory {self.path.rsplit('/', 1)[0]} is in use by "
            f"{record.describe() if record else 'a writer of an unreadable lease file'}: another driver runs this "
            "run name on this storage path. Stop that driver first, or start this job under another run name. "
            f"(A lease its driver stops renewing is taken over after {self._ttl_of(record):.0f}s.)"
        )

    def check(self) -> None:
        """Raise :class:`RunLeaseLostError` if a renewal found the lease lost (no storage read)."""
        if self.lost is not None:
            raise RunLeaseLostError(f"{self.lost}. This run stops writing; its committed checkpoints are kept.")

    def verify(self) -> None:
        """Read the lease and raise :class:`RunLeaseLostError` unless this run holds it (before a commit)."""
        self.check()
        if not self._still_ours(self._read_bytes()):
            self.check()

    def release(self) -> None:
        """Stop renewing and remove the lease if this object took it and still holds it: the run has ended."""
        held = self.held
        self.stop()
        if held and self.lost is None and (record := self.read_record()) is not None and record.run_id == self.run_id:
            self.filesystem.delete_file(self.path)

    def stop(self) -> None:
        """Stop renewing, leaving the lease to expire (the process is failing; a restart takes it back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def read_record(self) -> LeaseRecord | None:
        """The lease's record; None when there is none or it does not parse."""
        data = self._read_bytes()
        return parse_lease(data) if data is not None else None

    def _read_bytes(self) -> bytes | None:
        return self._read_versioned()[0]

    def _read_versioned(self) -> tuple[bytes | None, str | None]:
        """The lease file's bytes and their version (None without conditional writes); (None, None)
        when there is no lease file."""
        if self._conditional is not None:
            return self._conditional.read() or (None, None)
        try:
            with self.filesystem.open_input_stream(self.path) as stream:
                return stream.read(), None
        except FileNotFoundError:
            return None, None

    def _lose(self, record: LeaseRecord | None, data: bytes) -> None:
        if record is not None:
            self.lost = f"{record.describe()} took over the lease of this run's directory: another driver runs " \
                        "this run name on this storage path"
        else:
            self.lost = f"the lease file {self.path} no longer parses ({data[:80]!r}): something else wrote it"
        logger.error("Lost the run directory's lease: %s", self.lost)

    def _write_or_held(self, version: str | None) -> None:
        """Take the lease from ``version`` (None: no lease file); :class:`RunLeaseHeldError` when
        another run changed it since it was read (a process of this run leaves it this run's)."""
        try:
            self._write(version)
        except ChangedSinceRead:
            record = self.read_record()
            if record is None or record.run_id != self.run_id:
                raise self._held_error(record) from None

    def _write(self, version: str | None) -> None:
        """Write this run's record over ``version`` of the lease file (None: where there is none);
        with conditional writes, :class:`ChangedSinceRead` when that is not what is there."""
        now = self._clock()
        record = LeaseRecord(self.run_id, self.holder, now, now + self.ttl_s)
        data = json.dumps(asdict(record)).encode()
        if self._conditional is not None:
            self._conditional.write(data, version)
        elif isinstance(self.filesystem, pafs.LocalFileSystem):  # readers never see half a file
            temporary = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            with self.filesystem.open_output_stream(temporary) as out:
                out.write(data)
            self.filesystem.move(temporary, self.path)
        else:
            with self.filesystem.open_output_stream(self.path) as out:  # one PUT: atomic on object stores
                out.write(data)

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                if not self._renew_once():
                    return
            except OSError as err:  # storage hiccup: the next renewal retries, well before the expiry
                logger.warning("Renewing the run's lease %s failed (%s); retrying", self.path, err)

    def _renew_once(self) -> bool:
        """Renew the lease unless another run took it; False when it did (the lease is lost)."""
        data, version = self._read_versioned()
        if not self._still_ours(data):
            return False
        try:
            self._write(version)  # (a lease found missing, e.g. mid-replace by a replica of this run, is rewritten)
        except ChangedSinceRead:  # written between the read and the write: by whom, a read says
            return self._still_ours(self._read_bytes())
        return True

    def _still_ours(self, data: bytes | None) -> bool:
        """Whether the lease file's ``data`` leave the lease to this run (no file does); if not, it is lost."""
        record = parse_lease(data) if data is not None else None
        if data is not None and (record is None or record.run_id != self.run_id):
            self._lose(record, data)
            return False
        return True
