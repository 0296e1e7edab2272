"""One writer per run: a lease on the run's directory, held by rank 0 of the run while it trains.

Two drivers started with the same run name and storage path would write the same checkpoint
directory names, and each one's cleanup would delete the other's saves in flight. So rank 0
takes a lease (``<run dir>/.lease``: Ray Train's run id, the holder, the expiry) before it
lists or deletes anything, and renews it from a background thread. Ray Train's run id is the
same in every attempt of one ``trainer.fit()`` and new for every driver, so a restarted attempt
takes the lease straight back, and another driver's run finds it held and stops with
:class:`RunLeaseHeldError`, which names the holder. A lease that is not renewed (its driver
died) is taken over once it expires, at most ``ttl_s`` after its last renewal; one that is
renewed while it is watched belongs to a live run.

Storage offers no compare-and-swap (S3 through pyarrow), so two runs taking an expired lease at
the same moment could both write it: every renewal reads the lease first, and a holder that
finds another run's id there has lost it (:class:`RunLeaseLostError`): it commits no further
checkpoint and stops at its next step.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

import pyarrow.fs as pafs

from ray_resilient.checkpoint.errors import UnrecoverableRunError

logger = logging.getLogger(__name__)

LEASE_FILE = ".lease"
TTL_S = 30.0  # a lease not renewed for this long is taken over (its driver is gone)
RENEW_EVERY_S = 5.0


class RunLeaseHeldError(UnrecoverableRunError):
    """Another live run (another driver) holds the run directory."""


class RunLeaseLostError(UnrecoverableRunError):
    """Another run took over this run's directory while it trained."""


@dataclass(frozen=True)
class LeaseRecord:
    """The content of the lease file."""

    run_id: str
    holder: str  # host and process of the holding rank 0
    renewed: float  # wall-clock time of the last renewal
    expires: float

    def describe(self) -> str:
        return f"Ray Train run {self.run_id} ({self.holder}, renewed {time.time() - self.renewed:.0f}s ago)"


class RunLease:
    """The lease of ``run_id`` on the run directory ``experiment_path`` (see the module docstring)."""

    def __init__(self, filesystem: pafs.FileSystem, experiment_path: str, run_id: str, *,
                 ttl_s: float = TTL_S, renew_every_s: float = RENEW_EVERY_S):
        if not 0 < renew_every_s < ttl_s:
            raise ValueError(f"the lease needs 0 < renew_every_s < ttl_s, got {renew_every_s}, {ttl_s}")
        self.filesystem = filesystem
        self.path = f"{experiment_path}/{LEASE_FILE}"
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.renew_every_s = renew_every_s
        self.holder = f"host {socket.gethostname()} pid {os.getpid()}"
        self.lost_to: LeaseRecord | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this object took the lease and keeps renewing it."""
        return self._thread is not None

    def acquire(self) -> None:
        """Take the lease, and keep renewing it until :meth:`release`.

        A lease of another run is watched until it is renewed (that run is alive:
        :class:`RunLeaseHeldError`) or expires (it is taken over); at most ``ttl_s``.
        """
        found = self.read()
        if found is not None and found.run_id != self.run_id:
            if found.expires > time.time():
                logger.warning("The run directory is leased by %s; waiting up to %.0fs to see whether it is renewed",
                               found.describe(), found.expires - time.time())
                found = self._watch(found)
            if found is not None:
                logger.warning("Taking over the lease of %s: not renewed for %.0fs, its driver is gone",
                               found.describe(), time.time() - found.renewed)
        self._write()
        self._thread = threading.Thread(target=self._renew, name="ray_resilient_lease", daemon=True)
        self._thread.start()

    def _watch(self, found: LeaseRecord) -> LeaseRecord | None:
        """Watch another run's lease until it expires (returned, to be taken over) or is released
        (None); raise :class:`RunLeaseHeldError` as soon as it is renewed."""
        deadline = min(found.expires, time.time() + self.ttl_s)
        while time.time() < deadline:
            self._stop.wait(min(self.renew_every_s / 4, max(deadline - time.time(), 0.0)))
            current = self.read()
            if current is None or current.run_id == self.run_id:
                return None
            if current != found:
                raise RunLeaseHeldError(
                    f"the run directory {self.path.rsplit('/', 1)[0]} is in use by {current.describe()}: "
                    "another driver runs this run name on this storage path. Stop that driver first, or start "
                    "this job under another run name. (A lease its driver stops renewing is taken over after "
                    f"{self.ttl_s:.0f}s.)"
                )
        return found

    def check(self) -> None:
        """Raise :class:`RunLeaseLostError` if another run took the lease over."""
        if self.lost_to is not None:
            raise RunLeaseLostError(
                f"{self.lost_to.describe()} took over the lease of this run's directory: another driver runs this "
                "run name on this storage path. This run stops writing; its committed checkpoints are that run's now."
            )

    def release(self) -> None:
        """Stop renewing and remove the lease if this object took it and still holds it: the run has ended."""
        held = self.held
        self.stop()
        if held and self.lost_to is None and (record := self.read()) is not None and record.run_id == self.run_id:
            self.filesystem.delete_file(self.path)

    def stop(self) -> None:
        """Stop renewing, leaving the lease to expire (the process is failing; a restart takes it back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def read(self) -> LeaseRecord | None:
        try:
            with self.filesystem.open_input_stream(self.path) as stream:
                return LeaseRecord(**json.loads(stream.read()))
        except FileNotFoundError:
            return None

    def _write(self) -> None:
        now = time.time()
        record = LeaseRecord(self.run_id, self.holder, now, now + self.ttl_s)
        data = json.dumps(asdict(record)).encode()
        if isinstance(self.filesystem, pafs.LocalFileSystem):  # readers never see half a file
            with self.filesystem.open_output_stream(f"{self.path}.{os.getpid()}.tmp") as out:
                out.write(data)
            self.filesystem.move(f"{self.path}.{os.getpid()}.tmp", self.path)
        else:
            with self.filesystem.open_output_stream(self.path) as out:  # one PUT: atomic on object stores
                out.write(data)

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                record = self.read()
                if record is not None and record.run_id != self.run_id:
                    self.lost_to = record
                    logger.error("Lost the run directory's lease to %s", record.describe())
                    return
                self._write()
            except OSError as err:  # storage hiccup: the next renewal retries, well before the expiry
                logger.warning("Renewing the run's lease %s failed (%s); retrying", self.path, err)
