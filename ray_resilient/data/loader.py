"""The DataLoader for volume datasets: tuned defaults, an exact resumable position, fetch_seconds.

The position counts global batches *the training loop received*, not batches the workers
prefetched: a batch counts once ``next()`` returned it. At an epoch's end the position is
(next epoch, 0). Because the plan's sequence of global batches does not depend on the number of
ranks or workers, a position loads on a different world size (same global batch size) or a
different ``num_workers`` and continues the same global sequence.

In survivor mode (:class:`~ray_resilient.survivors.SurvivingReplicas` with ``data=`` the loader)
a replica reads micro-batches instead (:meth:`VolumeDataLoader.micro_batch`): the ones the
membership gives it, through the same workers, cache and prefetching; a step counts as received
once its last micro-batch of this replica was.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from ray_resilient.data.cache import CacheStats
from ray_resilient.data.dataset import Batch, StreamingVolumeDataset, VolumeImageDataset, WorkerBatch
from ray_resilient.tracking import MetricsLogger, resolve_metrics_logger

logger = logging.getLogger(__name__)


def default_num_workers(local_world_size: int = 1) -> int:
    """DataLoader workers per rank: the node's CPUs shared by its ranks, one left for the loop."""
    return max(1, min(8, (os.cpu_count() or 2) // max(local_world_size, 1) - 1))


@dataclass
class LoaderMetrics:
    """What the loader measured since it was created."""

    batches: int = 0
    fetch_seconds: float = 0.0  # total time the training loop blocked in next()
    last_fetch_seconds: float = 0.0
    skipped_samples: int = 0
    cache: CacheStats = field(default_factory=CacheStats)

    def as_dict(self) -> dict[str, float]:
        return {
            "fetch_seconds": self.last_fetch_seconds,
            "fetch_seconds_total": self.fetch_seconds,
            "cache_hits": self.cache.hits,
            "cache_misses": self.cache.misses,
            "bytes_downloaded": self.cache.bytes_downloaded,
            "download_mb_per_s": self.cache.download_bytes_per_second / 1e6,
            "skipped_samples": self.skipped_samples,
        }


class VolumeDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` over a volume dataset, with an exact position.

    Args:
        dataset: a :class:`VolumeImageDataset` or :class:`ParquetVolumeDataset` (it already
            knows the rank, world size and batch size).
        num_workers: worker processes (default: :func:`default_num_workers`).
        pin_memory: pin batches for fast host-to-GPU copies (default: when CUDA is available).
        persistent_workers: keep workers (and their prefetch windows and threads) across epochs.
        prefetch_factor: batches each worker prepares ahead.
        metrics_logger: called on rank 0 with (metrics, :attr:`global_batches`) every
            ``log_every`` global batches of the run: ``"mlflow"`` (the default: the MLflow run of
            the current Ray Train run, metric names prefixed ``data/``, from a background thread,
            so an MLflow outage never blocks or fails the loop), a callable, or None (see
            :func:`ray_resilient.tracking.resolve_metrics_logger`).
        log_every: global batches between two metrics_logger calls.
    """

    def __init__(
        self,
        dataset: StreamingVolumeDataset,
        *,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        prefetch_factor: int = 4,
        metrics_logger: MetricsLogger | str | None = "mlflow",
        log_every: int = 50,
        **kwargs: Any,
    ):
        num_workers = default_num_workers() if num_workers is None else num_workers
        dataset.check_workers(max(num_workers, 1))
        if num_workers > 0 and dataset.volume.is_remote:
            # The AWS SDK (pyarrow's S3) is not fork-safe: a forked worker reusing the parent's
            # client can read another request's bytes. Spawned workers make their own.
            kwargs.setdefault("multiprocessing_context", "spawn")
        super().__init__(
            dataset,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            **kwargs,
        )
        self.epoch = 0
        self.batch = 0  # global batches of this epoch the training loop received
        self._batches_before = (0, 0)  # (epoch, global batches of the epochs before it)
        self.metrics = LoaderMetrics()
        self.metrics_logger = resolve_metrics_logger(metrics_logger, prefix="data/", name="data",
                                                     enabled=dataset.rank == 0)
        self.log_every = log_every
        # Survivor mode: (replica, live replicas, micro-batches), and its stream of (step, item).
        self._assignment: tuple[int, int, int] | None = None
        self._micro_stream: Iterator[tuple[int, WorkerBatch]] | None = None
        self._due: tuple[int, int] | None = None  # the (step, micro-batch) the stream gives next

    @property
    def volume_dataset(self) -> StreamingVolumeDataset:
        return self.dataset  # type: ignore[return-value]

    @property
    def fetch_seconds(self) -> float:
        """Seconds the training loop has waited in ``next()`` so far (the checkpointer's
        :class:`~ray_resilient.lifecycle.DataWaitSource`)."""
        return self.metrics.fetch_seconds

    @property
    def samples_read(self) -> int:
        """Samples the dataset's processes have read so far, for batches not yet received too."""
        return self.volume_dataset.samples_read

    @property
    def loading_progress(self) -> int:
        """Samples read plus failed volume reads retried, by the dataset's processes (the
        checkpoint loop's :class:`~ray_resilient.lifecycle.DataProgressSource`)."""
        return self.volume_dataset.samples_read + self.volume_dataset.reads_retried

    @property
    def global_batches(self) -> int:
        """Global batches the run received so far, over every epoch and attempt: the training
        step when each batch is one step. Metrics are logged against it, so that curves continue
        across restarts."""
        if self._batches_before[0] != self.epoch:  # once per epoch: a Parquet plan's count takes a pass
            dataset = self.volume_dataset
            self._batches_before = (self.epoch, sum(dataset.batches_per_epoch(e) for e in range(self.epoch)))
        return self._batches_before[1] + self.batch

    def __len__(self) -> int:
        return self.volume_dataset.batches_per_epoch(self.epoch) - self.batch

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        """The rest of the current epoch; after its last batch the position is (next epoch, 0)."""
        dataset = self.volume_dataset
        dataset.set_start(self.epoch, self.batch)
        batches = super().__iter__()
        while True:
            started = time.monotonic()
            try:
                item = next(batches)
            except StopIteration:
                break
            waited = time.monotonic() - started
            if item.batch.global_batch != self.batch:
                raise RuntimeError(f"batch {item.batch.global_batch} arrived where {self.batch} was due")
            self.batch += 1
            if self.batch == dataset.batches_per_epoch(self.epoch):
                self.epoch, self.batch = self.epoch + 1, 0
            self._record(waited, item.cache, item.skipped)
            yield item.batch

    # --- survivor mode -------------------------------------------------------------------------

    def assign_micro_batches(self, step: int, rank: int, members: int, micro_batches: int) -> None:
        """From global step ``step`` on (global batches counted over epochs), read micro-batches
        ``rank, rank + members, ...`` of ``micro_batches`` of each global batch: the replica of
        rank ``rank`` among ``members`` live ones. The assignment the stream follows already, at
        the start of ``step``, changes nothing; any other (a re-formed membership, a dropped step
        trained again, a restore) starts the workers' streams again at ``step``."""
        dataset = self.volume_dataset
        if not isinstance(dataset, VolumeImageDataset):
            raise TypeError(f"survivor mode reads micro-batches of a VolumeImageDataset, not of a "
                            f"{type(dataset).__name__}")
        assignment = (rank, members, micro_batches)
        if assignment == self._assignment and self._due == (step, rank):
            return
        dataset.plan.check_micro_batches(micro_batches, rank, members)
        self.epoch, self.batch = self._position_of(step)
        self._assignment, self._due = assignment, (step, rank)
        self._micro_stream = self._micro_batches(self.epoch, self.batch, assignment)

    def micro_batch(self, step: int, part: int) -> Batch:
        """Micro-batch ``part`` of global step ``step``: the next of the stream
        :meth:`assign_micro_batches` set (a ``RuntimeError`` names the one due instead). The
        caller's torch RNG is left as it was."""
        if self._micro_stream is None or self._due != (step, part):
            raise RuntimeError(f"micro-batch {part} of step {step} was asked for where {self._due} is due: "
                               "assign_micro_batches(step, ...) first, then ask for its micro-batches in order")
        started = time.monotonic()
        item_step, item = next(self._micro_stream)
        waited = time.monotonic() - started
        if (item_step, item.batch.micro_batch) != (step, part):
            raise RuntimeError(f"micro-batch {item.batch.micro_batch} of step {item_step} arrived where "
                               f"{part} of {step} was due")
        rank, members, micro_batches = self._assignment
        last = part + members >= micro_batches
        self._due = (step + 1, rank) if last else (step, part + members)
        if last:
            self.batch += 1
            if self.batch == self.volume_dataset.batches_per_epoch(self.epoch):
                self.epoch, self.batch = self.epoch + 1, 0
        self._record(waited, item.cache, item.skipped, advanced=last)
        return item.batch

    def _micro_batches(self, epoch: int, batch: int, assignment: tuple[int, int, int]
                       ) -> Iterator[tuple[int, WorkerBatch]]:
        """(global step, item) of the replica's micro-batches from ``batch`` of ``epoch`` on, epoch after epoch."""
        dataset = self.volume_dataset
        while True:
            dataset.set_start(epoch, batch, assignment)
            before = sum(dataset.batches_per_epoch(e) for e in range(epoch))
            # Starting an iteration draws the DataLoader's base seed from torch's global RNG, here
            # inside survivor mode's loss_of, whose stream is its own (seed, step, micro-batch).
            with torch.random.fork_rng(devices=[]):
                items = super().__iter__()
            for item in items:
                yield before + item.batch.global_batch, item
            epoch, batch = epoch + 1, 0

    def _position_of(self, step: int) -> tuple[int, int]:
        """(epoch, batch) of global step ``step``."""
        epoch = 0
        while step >= (per_epoch := self.volume_dataset.batches_per_epoch(epoch)):
            epoch, step = epoch + 1, step - per_epoch
        return epoch, step

    def _record(self, waited: float, cache: CacheStats, skipped: int, advanced: bool = True) -> None:
        """Count a batch (or micro-batch) received; log when it ``advanced`` the position to a
        multiple of ``log_every``."""
        m = self.metrics
        m.batches += 1
        m.fetch_seconds += waited
        m.last_fetch_seconds = waited
        m.skipped_samples += skipped
        m.cache.hits += cache.hits
        m.cache.misses += cache.misses
        m.cache.bytes_downloaded += cache.bytes_downloaded
        m.cache.download_seconds += cache.download_seconds
        if self.metrics_logger is not None and advanced:
            step = self.global_batches
            if step % self.log_every == 0:
                self.metrics_logger(m.as_dict(), step)

    # --- position (a Stateful for the checkpoint's per-rank data slot) ---------------------------

    def state_dict(self) -> dict[str, Any]:
        dataset = self.volume_dataset
        return {
            "seed": dataset.seed,
            "epoch": self.epoch,
            "samples": self.batch * dataset.global_batch,
            "global_batch": dataset.global_batch,
            "fingerprint": dataset.fingerprint,
            "layout": dataset.layout(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dataset = self.volume_dataset
        if state["fingerprint"] != dataset.fingerprint:
            raise ValueError(
                f"the data position was saved for another volume listing (plan fingerprint {state['fingerprint']}, "
                f"this volume {dataset.fingerprint}): files were added, removed or changed since; "
                "resume on the same volume or start a new run"
            )
        if state["global_batch"] != dataset.global_batch or state["seed"] != dataset.seed:
            raise ValueError(
                f"the data position was saved with global batch {state['global_batch']} and seed {state['seed']}, "
                f"this loader has {dataset.global_batch} and {dataset.seed}: the global sample sequence would differ"
            )
        self.epoch = state["epoch"]
        self.batch = state["samples"] // dataset.global_batch
        if state["layout"] != dataset.layout():
            logger.warning(
                "data position saved for layout %s, resuming on %s: this dataset's order depends on the layout, "
                "so epoch %d restarts from its beginning (its samples seen so far are seen again)",
                state["layout"], dataset.layout(), self.epoch)
            self.batch = 0

    def load_resharded_state_dicts(self, states: list[dict[str, Any]]) -> None:
        """After a change of world size: the position is global, identical on every old rank."""
        if any(s != states[0] for s in states):
            raise ValueError(f"the ranks saved different data positions: {states}")
        self.load_state_dict(states[0])
