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
from typing import Any, Mapping

import pyarrow.fs as pafs

from ray_resilient.checkpoint.registration import register_durable

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
