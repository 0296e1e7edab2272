"""One writer per run: a fenced lease on the run's directory, held by rank 0 of the run while it trains.

Two drivers started with the same run name and storage path would write the same checkpoint
directory names, and each one's cleanup would delete the other's saves in flight. So rank 0
takes the lease before it deletes or writes anything, and renews it from a background thread.

**Generations.** The lease is a sequence of generation files, ``<run dir>/.leases/<generation>``
(Ray Train's run id, the holder, its renewal time). Every take (a new driver, a restarted attempt,
a survivor-mode lead change) creates the next generation's file, and only the writer that created
it holds that generation. The generation is the fencing token: it is the attempt number in every
checkpoint directory name the holder writes (``checkpoint_<step>_<generation>``), so two holders
never write the same names, and a holder whose generation is no longer the newest has lost the
run: each rank checks that before it writes or uploads a save's shards, and rank 0 before and
after it commits one (an unlucky late commit is withdrawn). Finished runs mark their generation
released instead of deleting it, so the numbers only grow.

**Creating a generation** is exclusive where storage can make it so: ``link()`` of a complete
file on POSIX filesystems (local disks, NFS), ``If-None-Match: *`` on S3. Everywhere else (GCS,
S3 stores that ignore the condition or reject it with 400 or 501: a probe finds out once), a
taker reads its file back ``settle_s`` after writing it, and gives up a take whose write finished
more than ``settle_s`` after the listing that found the generation free: if two takers both read
back their own record, the one whose write landed second must have taken longer than that, so at
most one goes on, whatever the write latency (reads and listings must be strongly consistent, as
on S3 and GCS; ``settle_s`` must exceed a usual write's latency: after :data:`GIVEN_UP_TAKES`
takes given up in a row, :class:`RunLeaseHeldError` says so).
``RAY_RESILIENT_CONDITIONAL_WRITES=0`` skips the conditions (and their probe) on S3.

**Taking over.** A restarted attempt of the same run (Ray Train's run id is the same in every
attempt of one ``trainer.fit()``, new for every driver) takes the next generation at once;
another run's live lease stops this one with :class:`RunLeaseHeldError`, which names the holder.
Clocks of different machines disagree, so the times in another run's lease are never trusted: a
taker watches the newest generation's file on its own monotonic clock, for the TTL its holder
declared (``expires - renewed``, at most :data:`MAX_FOREIGN_TTL_S`). A file that changes
meanwhile (renewed) belongs to a live run; one left unchanged that long (its driver died) is
taken over with the next generation.
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
from ray_resilient.storage.conditional import (
    AlreadyExists, ConditionsRejected, ExclusiveCreate, exclusive_create_for,
)
from ray_resilient.watchdog.progress import note_progress

logger = logging.getLogger(__name__)

LEASE_DIR = ".leases"
TTL_S = 30.0  # a lease not renewed for this long is taken over (its driver is gone)
RENEWALS_PER_TTL = 6  # the holder renews every ttl_s / 6 by default
SETTLE_S = 0.5  # a new holder reads its lease back this long after writing it (where creation is not exclusive)
MAX_FOREIGN_TTL_S = 3600.0  # the longest another run's lease is watched, whatever TTL it declares
KEPT_GENERATIONS = 2  # a new holder deletes the files of older generations
GIVEN_UP_TAKES = 3  # takes given up in a row (writes slower than settle_s) before acquire() stops trying
FAILED_RENEWALS_TO_ESCALATE = 3  # renewals failing this many times in a row are logged as errors
CONDITIONAL_WRITES_ENV = "RAY_RESILIENT_CONDITIONAL_WRITES"  # "0": no If-None-Match on S3


class RunLeaseHeldError(UnrecoverableRunError):
    """Another live run (another driver) holds the run directory."""


class RunLeaseLostError(UnrecoverableRunError):
    """Another writer took over this run's directory while it trained."""


@dataclass(frozen=True)
class LeaseRecord:
    """The content of a generation file (its times are the holder's clock: for people, not for expiry)."""

    run_id: str
    holder: str  # host and process of the holding rank 0
    renewed: float  # the holder's wall-clock time of the last renewal
    expires: float
    generation: int
    token: str  # the holding process's, unique to its take
    released: bool = False  # the run ended: the next taker need not wait

    def describe(self) -> str:
        return f"Ray Train run {self.run_id} ({self.holder})"

    @property
    def ttl_s(self) -> float:
        """The TTL its holder declared (how long it may go unrenewed)."""
        return self.expires - self.renewed


def parse_lease(data: bytes) -> LeaseRecord | None:
    """The record in a generation file's bytes; None when they are not one."""
    try:
        record = LeaseRecord(**json.loads(data))
    except (ValueError, TypeError):
        return None
    numbers = (record.renewed, record.expires)
    if not (isinstance(record.run_id, str) and isinstance(record.holder, str) and isinstance(record.token, str)
            and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in numbers)
            and type(record.generation) is int and isinstance(record.released, bool)):
        return None
    return record


def lease_dir(experiment_path: str) -> str:
    return f"{experiment_path}/{LEASE_DIR}"


def generation_path(experiment_path: str, generation: int) -> str:
    return f"{lease_dir(experiment_path)}/{generation:010d}"


def list_generations(filesystem: pafs.FileSystem, experiment_path: str) -> list[int]:
    """The run's lease generations that have a file, oldest first."""
    selector = pafs.FileSelector(lease_dir(experiment_path), allow_not_found=True)
    return sorted(int(info.base_name) for info in filesystem.get_file_info(selector)
                  if info.base_name.isdigit() and info.type == pafs.FileType.File)


def check_fence(filesystem: pafs.FileSystem, experiment_path: str, generation: int) -> None:
    """:class:`RunLeaseLostError` when a generation newer than ``generation`` was taken: a writer of
    ``generation`` has been fenced off (before a save's shards are written or uploaded)."""
    newest = max(list_generations(filesystem, experiment_path), default=-1)
    if newest > generation:
        raise RunLeaseLostError(
            f"the run directory {experiment_path} was taken over (lease generation {newest}) while this writer "
            f"held generation {generation}: another driver, or a newer attempt of this run, writes it now")


class RunLease:
    """The lease of ``run_id`` on the run directory ``experiment_path`` (see the module docstring).

    Args:
        conditional_writes: create generations with ``If-None-Match`` on S3 (default: unless
            ``RAY_RESILIENT_CONDITIONAL_WRITES=0``).
        exclusive: the conditional requests' client (default: signed requests to the endpoint of
            ``filesystem``, an S3 one).
    """

    def __init__(self, filesystem: pafs.FileSystem, experiment_path: str, run_id: str, *,
                 ttl_s: float = TTL_S, renew_every_s: float | None = None, settle_s: float = SETTLE_S,
                 clock: Callable[[], float] = time.time, conditional_writes: bool | None = None,
                 exclusive: ExclusiveCreate | None = None):
        if renew_every_s is None:
            renew_every_s = ttl_s / RENEWALS_PER_TTL
        if not 0 < renew_every_s < ttl_s:
            raise ValueError(f"the lease needs 0 < renew_every_s < ttl_s, got {renew_every_s}, {ttl_s}")
        if conditional_writes is None:
            conditional_writes = os.environ.get(CONDITIONAL_WRITES_ENV, "1") != "0"
        self.filesystem = filesystem
        self.experiment_path = experiment_path
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.renew_every_s = renew_every_s
        self.settle_s = settle_s
        self.holder = f"host {socket.gethostname()} pid {os.getpid()}"
        self.generation: int | None = None  # the generation this object took last
        self.lost: str | None = None  # why this holder lost the lease
        self._local = isinstance(filesystem, pafs.LocalFileSystem)
        self._exclusive = (exclusive or exclusive_create_for(filesystem)) if conditional_writes else None
        self._enforced: bool | None = None  # whether the store enforces the condition (probed once)
        self._token = ""
        self._abandoned: set[int] = set()  # generations this object wrote but did not take
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, after: int = -1) -> int:
        """Take the next generation of the lease (above ``after``: the attempt numbers already on
        storage), and keep renewing it until :meth:`release`; returns the generation. A holder
        taking it again gets a new generation (its previous one is fenced off).

        The newest generation of another run is watched for the TTL its holder declared (a file
        that does not parse, for ``ttl_s``): renewed meanwhile, :class:`RunLeaseHeldError`;
        unchanged, it is taken over. A taker that loses the creation of a generation to another
        writer also gets :class:`RunLeaseHeldError`.
        """
        self.stop()
        self._stop = threading.Event()
        dead: tuple[int, bytes] | None = None  # a generation found unchanged for its TTL
        given_up = 0  # takes of this call given up (writes slower than settle_s)
        while True:
            listed_at = time.monotonic()
            newest = max(list_generations(self.filesystem, self.experiment_path), default=-1)
            if newest >= 0:
                found = self._read(newest)
                if found is None:  # deleted by a newer holder since the listing
                    continue
                record = parse_lease(found)
                if dead != (newest, found) and not self._free(newest, record):
                    watch_s = self._ttl_of(record)
                    holder = record.describe() if record else "an unreadable lease file"
                    logger.warning("The run directory is leased by %s; watching it for %.0fs to see whether it is "
                                   "renewed", holder, watch_s)
                    if self._watch(newest, found, watch_s):
                        logger.warning("Taking over the lease of %s: not renewed for %.0fs, its driver is gone",
                                       holder, watch_s)
                        dead = (newest, found)
                    continue  # listed again: the dead generation is taken only if it is still the newest
            generation = max(newest, after) + 1
            if self._take(generation, listed_at):
                break
            given_up += 1
            if given_up >= GIVEN_UP_TAKES:
                raise RunLeaseHeldError(
                    f"could not take the lease of the run directory {self.experiment_path}: {given_up} "
                    f"takes were given up, each because writing its file took longer than settle_s="
                    f"{self.settle_s:g}s (on storage without exclusive creation a slower write could let two "
                    "drivers go on). Is the storage overloaded? Where it supports exclusive creation, let the lease "
                    f"use it (unset {CONDITIONAL_WRITES_ENV}).")
        self.generation, self.lost = generation, None
        self._prune(generation)
        self._thread = threading.Thread(target=self._renew, name="ray_resilient_lease", daemon=True)
        self._thread.start()
        return generation

    def _free(self, generation: int, record: LeaseRecord | None) -> bool:
        """Whether ``generation``'s holder lets a taker go on at once: it ended, or it is this run's."""
        return record is not None and (record.released or record.run_id == self.run_id
                                       and generation not in self._abandoned)

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

    def _watch(self, generation: int, found: bytes, watch_s: float) -> bool:
        """Watch ``generation``'s file, holding ``found``, for ``watch_s`` on this machine's
        monotonic clock: True when unchanged that long (to be taken over), False when it may be
        taken now (released, removed, or a newer generation appeared); :class:`RunLeaseHeldError`
        as soon as another run renews it."""
        deadline = time.monotonic() + watch_s
        while (left := deadline - time.monotonic()) > 0:
            self._stop.wait(min(self.renew_every_s / 4, left))
            note_progress()  # a wait bounded by the watched lease's TTL, not a hang
            if max(list_generations(self.filesystem, self.experiment_path), default=-1) != generation:
                return False
            current = self._read(generation)
            if current is None:
                return False
            if current != found:
                record = parse_lease(current)
                if self._free(generation, record):
                    return False
                raise self._held_error(record)
        return True

    def _take(self, generation: int, listed_at: float) -> bool:
        """Create ``generation``'s file holding this run's record (see the module docstring); False
        when this take must be given up and the lease looked at again; :class:`RunLeaseHeldError`
        when another writer created it."""
        self._token = uuid.uuid4().hex
        path = generation_path(self.experiment_path, generation)
        data = self._record_bytes(generation)
        if self._local:
            exclusive, created = True, _link_new(path, data)
        else:
            self.filesystem.create_dir(lease_dir(self.experiment_path), recursive=True)
            exclusive, created = self._create(path, data)
        if not created:
            raise self._held_error(self._read_record(generation))
        if not exclusive:
            took_s = time.monotonic() - listed_at
            if took_s > self.settle_s:  # another taker may have read its own record back before this write landed
                self._abandoned.add(generation)
                logger.warning("Taking lease generation %d took %.1fs from the listing to the written file, more "
                               "than settle_s=%.1fs: given up, looking again", generation, took_s, self.settle_s)
                return False
            self._stop.wait(self.settle_s)  # a taker writing at the same moment: the last write stands
            current = self._read_record(generation)
            if current is None or current.token != self._token:
                raise self._held_error(current)
        return self._newest_is(generation)

    def _create(self, path: str, data: bytes) -> tuple[bool, bool]:
        """Write a generation file on remote storage: (whether exclusively, whether created)."""
        if self._exclusive is not None and self._enforced is None:
            try:
                self._enforced = self._exclusive.enforced(lease_dir(self.experiment_path))
            except ConditionsRejected as err:
                self._enforced = False
                logger.warning("The S3 store refuses conditional writes (%s)", err)
            if not self._enforced:
                logger.warning("The S3 store does not enforce If-None-Match: the lease takes generations with its "
                               "read-back protocol (set %s=0 to skip this check)", CONDITIONAL_WRITES_ENV)
        if self._enforced:
            try:
                self._exclusive.create(path, data)
            except AlreadyExists:
                return True, False
            return True, True
        with self.filesystem.open_output_stream(path) as out:  # one PUT: atomic on object stores
            out.write(data)
        return False, True

    def _newest_is(self, generation: int) -> bool:
        """After a take: :class:`RunLeaseHeldError` when a newer generation was taken meanwhile."""
        newest = max(list_generations(self.filesystem, self.experiment_path), default=-1)
        if newest > generation:
            raise self._held_error(self._read_record(newest))
        return True

    def _prune(self, generation: int) -> None:
        """Delete the files of generations older than the last :data:`KEPT_GENERATIONS` (best effort)."""
        for old in list_generations(self.filesystem, self.experiment_path):
            if old <= generation - KEPT_GENERATIONS:
                try:
                    self.filesystem.delete_file(generation_path(self.experiment_path, old))
                except OSError as err:
                    logger.info("Could not delete lease generation %d (%s)", old, err)

    def _held_error(self, record: LeaseRecord | None) -> RunLeaseHeldError:
        return RunLeaseHeldError(
            f"the run directory {self.experiment_path} is in use by "
            f"{record.describe() if record else 'a writer of an unreadable lease file'}: another driver runs this "
            "run name on this storage path. Stop that driver first, or start this job under another run name. "
            f"(A lease its driver stops renewing is taken over after {self._ttl_of(record):.0f}s.)"
        )

    def check(self) -> None:
        """Raise :class:`RunLeaseLostError` if a renewal found the lease lost (no storage read)."""
        if self.lost is not None:
            raise RunLeaseLostError(f"{self.lost}. This run stops writing; its committed checkpoints are kept.")

    def verify(self) -> None:
        """List the generations and raise :class:`RunLeaseLostError` unless this holder's is the newest."""
        self.check()
        if not self._still_newest():
            self.check()

    def commit(self, write: Callable[[], None], withdraw: Callable[[], None]) -> None:
        """Commit a checkpoint under the lease: :meth:`verify`, ``write`` the commit marker, verify
        again; a holder fenced off meanwhile (paused past its TTL) ``withdraw``\\ s the marker and raises."""
        self.verify()
        write()
        try:
            self.verify()
        except RunLeaseLostError:
            logger.error("The lease was lost while committing a checkpoint: withdrawing the commit")
            withdraw()
            raise

    def release(self) -> None:
        """Stop renewing and mark this holder's generation released (the run ended) if it still
        holds the newest one; nothing is deleted."""
        self.stop()
        if self.generation is not None and self.lost is None and self._still_newest():
            self._write(released=True)

    def stop(self) -> None:
        """Stop renewing, leaving the lease to expire (the process is failing; a restart takes it back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def read_record(self) -> LeaseRecord | None:
        """The newest generation's record; None when there is none or it does not parse."""
        newest = max(list_generations(self.filesystem, self.experiment_path), default=-1)
        return self._read_record(newest) if newest >= 0 else None

    def _read_record(self, generation: int) -> LeaseRecord | None:
        data = self._read(generation)
        return parse_lease(data) if data is not None else None

    def _read(self, generation: int) -> bytes | None:
        try:
            with self.filesystem.open_input_stream(generation_path(self.experiment_path, generation)) as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def _record_bytes(self, generation: int, released: bool = False) -> bytes:
        now = self._clock()
        record = LeaseRecord(self.run_id, self.holder, now, now + self.ttl_s, generation, self._token, released)
        return json.dumps(asdict(record)).encode()

    def _write(self, released: bool = False) -> None:
        """Rewrite this holder's generation file (renewed now; ``released`` at the run's end)."""
        path = generation_path(self.experiment_path, self.generation)
        data = self._record_bytes(self.generation, released)
        if self._local:  # readers never see half a file
            temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            with open(temporary, "wb") as out:
                out.write(data)
            os.replace(temporary, path)
        else:
            with self.filesystem.open_output_stream(path) as out:
                out.write(data)

    def _renew(self) -> None:
        failures = 0
        while not self._stop.wait(self.renew_every_s):
            try:
                if not self._still_newest():
                    return
                self._write()
                failures = 0
            except Exception as err:  # noqa: BLE001 (storage or credential errors: the next renewal retries)
                failures += 1
                level = logging.ERROR if failures >= FAILED_RENEWALS_TO_ESCALATE else logging.WARNING
                logger.log(level, "Renewing the run's lease %s failed %d time(s) in a row (%s: %s); retrying. "
                           "Past its TTL (%.0fs) another driver may take the run over; commits check it first.",
                           generation_path(self.experiment_path, self.generation), failures, type(err).__name__,
                           err, self.ttl_s)

    def _still_newest(self) -> bool:
        """Whether this holder's generation is still the newest; if not, the lease is lost."""
        if self.generation is None:
            raise RuntimeError("the run's lease was never acquired")
        newest = max(list_generations(self.filesystem, self.experiment_path), default=-1)
        if newest <= self.generation:
            return True
        record = self._read_record(newest)
        self.lost = (f"{record.describe() if record else 'another writer'} took over the lease of this run's "
                     f"directory (generation {newest}, this holder's {self.generation}): another driver runs this "
                     "run name on this storage path, or a newer attempt of this run")
        logger.error("Lost the run directory's lease: %s", self.lost)
        return False


def _link_new(path: str, data: bytes) -> bool:
    """Create the local file ``path`` holding ``data``, complete, unless it exists (``link()`` is
    atomic and exclusive on POSIX filesystems, NFS included); False when it existed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    with open(temporary, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)
