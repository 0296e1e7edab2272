"""A replica's registrations of the lead's checkpoints with Ray, made off the training thread.

Every Ray Train report is a barrier across the whole worker group, so the replicas register
together: at the same step boundary, all of them, only while every replica trains (the lead says
when in the step's exchange; a replica missing from the membership would never arrive), or at the
run's end once a process of every replica is up. The
lead passes the checkpoint, the others none (:func:`~ray_resilient.checkpoint.registration.register_durable`).

The reports run in order on a thread of each replica's own: a replica lost while the others wait
at Ray's barrier stalls no step. Ray resets that barrier when it replaces the lost replica, and the
waiting reports are skipped (Ray logs it), as are those not yet consolidated; the lead offers them
again once the replacement is taken in (:mod:`.replicas`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Mapping

import pyarrow.fs as pafs
import ray.train

from ray_resilient.checkpoint.layout import parse_checkpoint_dir_name
from ray_resilient.checkpoint.registration import reaches_ray, register_durable
from ray_resilient.storage.run import RunStorage

if TYPE_CHECKING:
    from ray_resilient.checkpoint.layout import CheckpointDir
    from ray_resilient.checkpoint.restore import RestorePlan
    from ray_resilient.checkpoint.state import TrainState
    from ray_resilient.checkpoint.writer import SaveResult

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 60.0  # how long a replica that ends waits for its registrations to go through


class Registrations:
    """One replica's registrations, made in the order submitted on a daemon thread."""

    def __init__(self, filesystem: pafs.FileSystem):
        self._filesystem = filesystem
        self._queue: queue.Queue[tuple[dict[str, Any], str | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ray-registrations", daemon=True)
        self._thread.start()

    def submit(self, metrics: Mapping[str, Any], path: str | None) -> None:
        """Register the durable checkpoint at ``path`` (None: this replica's part of another's)."""
        self._queue.put((dict(metrics), path))

    def close(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Wait until the registrations submitted were made (at most ``timeout_s``); False if not."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("Registrations with Ray still waiting after %.0f s (a replica was lost at Ray's "
                           "barrier); Result.checkpoint may be an older checkpoint", timeout_s)
            return False
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            metrics, path = item
            try:
                register_durable(metrics, path, self._filesystem)
            except Exception:  # noqa: BLE001 - a registration lost leaves the checkpoint durable
                logger.warning("Registering the checkpoint of step %s with Ray failed", metrics.get("step"),
                               exc_info=True)


class Offers:
    """Which of the lead's durable checkpoints Ray has, and which wait to be offered to it.

    Every replica keeps the steps (each registers at the same points); the lead also keeps the
    checkpoints, as the registrar of its checkpoint loop
    (:class:`~ray_resilient.checkpoint.loop.Registrar`): a durable checkpoint waits in
    :attr:`unregistered` (oldest first) until the lead offers it, at a step every replica trains;
    none does when ``storage`` is not Ray's run directory.
    """

    def __init__(self, storage: RunStorage) -> None:
        self._reaches_ray = reaches_ray(storage)
        checkpoint = ray.train.get_checkpoint()
        parsed = parse_checkpoint_dir_name(checkpoint.path.rsplit("/", 1)[-1]) if checkpoint is not None else None
        self.registered_step = parsed[0] if parsed is not None else -1  # the newest offered to Ray
        self.ray_step = self.registered_step  # the newest Ray had as a process of this run last started
        self.unregistered: deque[tuple[int, str]] = deque()  # the lead's durable (step, path) not offered yet
        self.offered: deque[tuple[int, str]] = deque()  # the lead's offered since ray_step (Ray may skip them)

    def opened(self, plan: RestorePlan, resumed: tuple[CheckpointDir, TrainState] | None) -> int | None:
        """The complete checkpoints Ray lacks (a lost lead's, or the one about to be restored) wait to
        be offered; those a lost lead offered are offered again if Ray skipped them."""
        newer = [(c.step, c.path) for c in reversed(plan.candidates) if c.step > self.ray_step and self._reaches_ray]
        self.offered = deque(entry for entry in newer if entry[0] <= self.registered_step)
        self.unregistered = deque(entry for entry in newer if entry[0] > self.registered_step)
        return None

    def durable(self, result: SaveResult, metrics: Mapping[str, Any]) -> bool:
        if self._reaches_ray:
            self.unregistered.append((result.step, result.path))
        return False

    def final(self, metrics: Mapping[str, Any]) -> None:
        """The final metrics go with the run's last registration (the coordinator's end of the run)."""

    def take(self, step: int, is_lead: bool) -> str | None:
        """Register the checkpoint of ``step`` now (every replica at the same point): the lead's path."""
        path = None
        if is_lead:
            offered, path = self.unregistered.popleft()
            assert offered == step, (offered, step)
            self.offered.append((offered, path))
        self.registered_step = step
        return path

    def skipped_again(self, ray_registered: int, is_lead: bool) -> None:
        """Ray had registered the checkpoints up to step ``ray_registered`` as the processes just taken
        in started: it skipped the registrations offered after it (it resets its report barrier when
        it replaces a replica, and drops the reports waiting there). The lead offers them again, first."""
        if is_lead:
            self.unregistered.extendleft(reversed([entry for entry in self.offered if entry[0] > ray_registered]))
            self.offered.clear()
        self.ray_step = ray_registered
        self.registered_step = min(self.registered_step, ray_registered)
