"""Multi-sample files: Parquet files whose rows are samples (image bytes and a label).

The plan shards *whole files*: each epoch the files are permuted from (seed, epoch) and dealt
to the ``W x K`` (rank, DataLoader worker) slots in turn, so every worker downloads and caches
only its own files. A worker streams its files' rows through a shuffle buffer of
``shuffle_window`` rows, seeded from (seed, epoch, slot): the working set stays a few files.

Every rank gets the same number of batches: each slot yields ``m`` batches, ``m`` being the
fewest whole per-rank batches any slot's rows fill in that epoch (the rest of the rows is
dropped for that epoch). Because files are dealt to slots, the order depends on the number of
ranks and workers: a position saved on one layout resumes exactly on the same layout; on
another, the epoch restarts from its beginning (with a warning).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from ray_resilient.data.config import StreamingConfig
from ray_resilient.data.dataset import StreamingVolumeDataset, WorkerBatch
from ray_resilient.data.plan import derive_seed
from ray_resilient.data.prefetch import Prefetcher
from ray_resilient.data.volume import Volume

logger = logging.getLogger(__name__)

# A Parquet file holds many samples: a few files make a window, downloaded by fewer threads.
PARQUET_STREAMING = StreamingConfig(prefetch_files=4, prefetch_bytes=512 << 20, prefetch_threads=2)


class ParquetPlan:
    """Which files each (rank, worker) slot reads in an epoch, and how many batches it yields."""

    def __init__(self, row_counts: list[int], per_rank_batch: int, slots: int, seed: int):
        if len(row_counts) < slots:
            raise ValueError(
                f"{len(row_counts)} Parquet files cannot feed {slots} (rank, worker) slots: every DataLoader "
                "worker of every rank needs at least one whole file; use fewer workers or split the files"
            )
        self.row_counts, self.per_rank_batch, self.slots, self.seed = row_counts, per_rank_batch, slots, seed

    def files(self, epoch: int, slot: int) -> list[int]:
        order = np.random.default_rng(derive_seed(self.seed, epoch)).permutation(len(self.row_counts))
        return order[slot::self.slots].tolist()

    @functools.lru_cache(maxsize=4)  # asked on every batch by the loader
    def batches_per_slot(self, epoch: int) -> int:
        rows = [sum(self.row_counts[f] for f in self.files(epoch, s)) for s in range(self.slots)]
        batches = min(rows) // self.per_rank_batch
        if batches < 1:
            raise ValueError(
                f"epoch {epoch}: a (rank, worker) slot has only {min(rows)} rows, less than one batch of "
                f"{self.per_rank_batch}; use fewer workers, a smaller batch or more rows per file"
            )
        return batches


class ParquetVolumeDataset(StreamingVolumeDataset):
    """Samples stored as rows of Parquet files on a :class:`Volume`.

    Args (besides :class:`StreamingVolumeDataset`'s):
        world_size: the number of ranks. num_workers: DataLoader workers per rank (the
            plan deals files to ``world_size * num_workers`` slots, so it must be known here).
        image_column, label_column: the columns holding encoded image bytes and the label.
        shuffle_window: rows in each worker's shuffle buffer.
        streaming: defaults to ``PARQUET_STREAMING``; change one knob with
            ``dataclasses.replace(PARQUET_STREAMING, cache_limit=...)``.
    """

    def __init__(
        self,
        volume: Volume,
        *,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 1,
        seed: int = 0,
        image_column: str = "image",
        label_column: str = "label",
        shuffle_window: int = 1024,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        streaming: StreamingConfig = PARQUET_STREAMING,
        skip_corrupt: bool = False,
    ):
        super().__init__(volume, global_batch=global_batch, rank=rank, seed=seed, transform=transform,
                         streaming=streaming, skip_corrupt=skip_corrupt)
        if global_batch % world_size:
            raise ValueError(f"global batch size {global_batch} is not divisible by the world size {world_size}")
        self.world_size, self.num_workers = world_size, max(num_workers, 1)
        self.image_column, self.label_column = image_column, label_column
        self.shuffle_window = shuffle_window
        row_counts = [self._row_count(f.path) for f in volume.files]
        self.row_offsets = np.concatenate([[0], np.cumsum(row_counts)]).tolist()
        self.plan = ParquetPlan(row_counts, global_batch // world_size, world_size * self.num_workers, seed)

    def _row_count(self, path: str) -> int:
        with self.volume.filesystem.open_input_file(f"{self.volume.root}/{path}") as handle:
            return pq.ParquetFile(handle).metadata.num_rows

    def batches_per_epoch(self, epoch: int) -> int:
        return self.plan.batches_per_slot(epoch) * self.num_workers

    def check_workers(self, num_workers: int) -> None:
        if num_workers != self.num_workers:
            raise ValueError(f"the dataset was planned for {self.num_workers} workers per rank, the loader has "
                             f"{num_workers}: pass the same num_workers to both")

    def layout(self) -> str:
        return f"{self.world_size}x{self.num_workers}"

    def __iter__(self) -> Iterator[WorkerBatch]:
        worker, _workers, epoch, start = self._worker()
        # The DataLoader asks its workers round-robin from worker 0, while batch j*K + k belongs
        # to plan worker k: resuming at ``start``, DataLoader worker w plays plan worker (w + start) % K.
        role = (worker + start) % self.num_workers
        slot = self.rank * self.num_workers + role
        done = len(range(role, start, self.num_workers))  # this role's batches already consumed
        prefetcher = self._get_prefetcher()
        prefetcher.restart(itertools.chain.from_iterable(self.plan.files(e, slot) for e in itertools.count(epoch)))
        files = self.plan.files(epoch, slot)
        rows = self._shuffled_rows(epoch, slot, files, prefetcher)
        per_rank = self.plan.per_rank_batch
        for j in range(self.plan.batches_per_slot(epoch)):
            chunk = list(itertools.islice(rows, per_rank))
            if j < done:
                continue  # fast-forward through batches the training loop already consumed
            samples = [(row_id, self._sample(torch.frombuffer(bytearray(data), dtype=torch.uint8), f"row {row_id}",
                                             epoch, row_id), label) for row_id, data, label in chunk]
            yield self._worker_batch(samples, j * self.num_workers + role)

    def _shuffled_rows(
        self, epoch: int, slot: int, files: list[int], prefetcher: Prefetcher
    ) -> Iterator[tuple[int, bytes, int]]:
        """(global row id, image bytes, label) of the slot's files through a seeded shuffle buffer."""
        rng = np.random.default_rng(derive_seed(self.seed, epoch, 1_000_003 + slot))
        buffer: list[tuple[int, bytes, int]] = []
        for file in files:
            table = prefetcher.read(file, lambda path: pq.read_table(path, columns=[self.image_column,
                                                                                   self.label_column]))
            offset = self.row_offsets[file]
            images = table.column(self.image_column).to_pylist()
            labels = table.column(self.label_column).to_pylist()
            for i, (image, label) in enumerate(zip(images, labels)):
                buffer.append((offset + i, image, int(label)))
                if len(buffer) >= self.shuffle_window:
                    yield buffer.pop(int(rng.integers(len(buffer))))
        while buffer:
            yield buffer.pop(int(rng.integers(len(buffer))))
