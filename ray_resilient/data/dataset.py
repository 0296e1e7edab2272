"""The volume image dataset: each DataLoader worker serves its share of the plan, prefetched and cached.

A batch goes volume -> cache -> plan -> dataset worker -> loader -> train step. Decoding
(``torchvision.io.decode_image``) and augmentation (``torchvision.transforms.v2``) run in the
workers. The randomness of a sample's augmentation is seeded from (seed, epoch, sample index),
so it does not depend on which rank or worker processed it.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from ray_resilient.data.cache import CacheStats, FileCache
from ray_resilient.data.config import StreamingConfig
from ray_resilient.data.plan import SamplePlan, derive_seed, fingerprint
from ray_resilient.data.prefetch import Prefetcher
from ray_resilient.data.volume import Volume, VolumeError
from ray_resilient.storage.node_local import DATA_CACHE, node_local_dir

logger = logging.getLogger(__name__)

READ_COUNTER_SLOTS = 64  # worker processes counted apart (more share slots: still progress, no longer exact)


class CorruptSampleError(VolumeError):
    """A file of the volume could not be decoded."""


class Batch(NamedTuple):
    """One rank's share of a global batch (in survivor mode: one micro-batch of it)."""

    images: torch.Tensor  # [N, C, H, W], as the transform leaves them
    labels: torch.Tensor  # [N] class indices (ImageFolder), -1 without labels
    sample_ids: torch.Tensor  # [N] indices into the volume's file list
    global_batch: int  # the global batch number within its epoch
    micro_batch: int = 0  # survivor mode's micro-batch of the global batch


class WorkerBatch(NamedTuple):
    """What a worker hands the loader: the batch plus the worker's cache activity since the last one."""

    batch: Batch
    cache: CacheStats
    skipped: int


def default_cache_dir(volume: Volume) -> str:
    """``$TMPDIR/ray-resilient/cache/<digest of the volume URI>``: one directory per volume, private
    to the user (:func:`~ray_resilient.storage.node_local.node_local_dir`).

    Files are cached by their path relative to the volume root, so two volumes must never share
    a directory.
    """
    return node_local_dir(DATA_CACHE, hashlib.sha256(volume.uri.encode()).hexdigest()[:16])


def read_bytes(path: str) -> torch.Tensor:
    """A local file's bytes as a ``uint8`` tensor (half the time of ``torchvision.io.read_file``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = bytearray(os.fstat(fd).st_size)
        if os.readv(fd, [data]) != len(data):
            raise OSError(f"{path} changed while it was read")
    finally:
        os.close(fd)
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def default_transform(image_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Training augmentation at ``image_size``, as float in [0, 1]: the shorter side resized to
    ``image_size``, a random ``image_size`` crop of it padded by an eighth (reflected), a random flip.

    It keeps the scale :func:`eval_transform` gives, so evaluation sees images like those trained
    on. ``RandomResizedCrop`` does not: it always resamples, which smooths pixel noise (on the
    generated shapes, half the difference between neighbouring pixels), so evaluation images are
    sharper than any trained on; BatchNorm's running statistics then do not fit them, and a small
    ResNet's validation accuracy swung between 0.6 and 1.0 with the seed or the CPU's kernels.
    """
    return v2.Compose([
        v2.Resize(image_size, antialias=True),
        v2.RandomCrop(image_size, padding=max(image_size // 8, 1), padding_mode="reflect"),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
    ])


def eval_transform(image_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Evaluation at ``image_size``, as float in [0, 1]: shorter side resized, centre crop."""
    return v2.Compose([
        v2.Resize(image_size, antialias=True),
        v2.CenterCrop(image_size),
        v2.ToDtype(torch.float32, scale=True),
    ])


class StreamingVolumeDataset(IterableDataset):
    """What every volume dataset shares: the cache, the prefetcher, and the start position.

    Subclasses define the plan (``batches_per_epoch``, ``check_workers``, ``layout``) and
    ``__iter__``; the loader drives them through these methods.

    Args:
        volume: the files (and labels).
        global_batch: samples per global batch (all ranks together).
        rank: this rank (Ray Train's world rank).
        seed: seeds the order of every epoch and every sample's augmentation.
        streaming: the cache directory and limit, and each worker's prefetch window.
        skip_corrupt: skip (and count) samples that fail to decode instead of raising.
        transform: applied to each decoded ``uint8`` CHW image; must give equal shapes
            (default: to float in [0, 1]).
    """

    def __init__(
        self,
        volume: Volume,
        *,
        global_batch: int,
        rank: int,
        seed: int,
        transform: Callable[[torch.Tensor], torch.Tensor] | None,
        streaming: StreamingConfig,
        skip_corrupt: bool,
    ):
        self.volume = volume
        self.global_batch, self.rank, self.seed = global_batch, rank, seed
        self.fingerprint = fingerprint(volume.listing())
        self.streaming = streaming
        self.cache_dir = streaming.cache_dir if streaming.cache_dir is not None else default_cache_dir(volume)
        FileCache(self.cache_dir, streaming.cache_limit)  # fail now on an unwritable directory, and clean up a crash
        self.skip_corrupt = skip_corrupt
        self.transform = transform if transform is not None else v2.ToDtype(torch.float32, scale=True)
        # (epoch, first batch) of the next iteration and, in survivor mode, (replica, live
        # replicas, micro-batches): set by the loader in the main process and read by the workers,
        # which (persistent or not) start from them. 0 live replicas: the rank's share.
        self._start = multiprocessing.get_context().RawArray("q", 5)
        # Samples read, a slot per worker process (one writer each: exact without a lock, which
        # spawned workers could not share).
        self._samples_read = multiprocessing.get_context().RawArray("q", READ_COUNTER_SLOTS)
        self._reads_retried = multiprocessing.get_context().RawArray("q", READ_COUNTER_SLOTS)  # likewise
        self._prefetcher: Prefetcher | None = None
        self._reported = CacheStats()

    def batches_per_epoch(self, epoch: int) -> int:
        """Batches each rank gets in ``epoch`` (equal on every rank)."""
        raise NotImplementedError

    def check_workers(self, num_workers: int) -> None:
        """Fail clearly when a DataLoader worker would get nothing."""
        raise NotImplementedError

    def layout(self) -> str | None:
        """The topology a position depends on (None: it continues on any world size and workers)."""
        return None

    @property
    def samples_read(self) -> int:
        """Samples read so far (counted as each one's decoding starts), by every process iterating
        this dataset: the hang watchdog's progress while the training loop waits for a batch."""
        return sum(self._samples_read)

    @property
    def reads_retried(self) -> int:
        """Failed reads of the volume retried so far, by every process iterating this dataset: the
        hang watchdog's progress while the volume retries (its ``retry_seconds`` bound them)."""
        return sum(self._reads_retried)

    def _count_retry(self) -> None:
        info = get_worker_info()
        self._reads_retried[(info.id if info is not None else 0) % READ_COUNTER_SLOTS] += 1

    def set_start(self, epoch: int, batch: int, micro_batches: tuple[int, int, int] | None = None) -> None:
        """Where the next iteration starts: the rank's batch ``batch`` of ``epoch``; in survivor
        mode (``micro_batches``: this replica's rank, the live replicas, micro-batches per global
        batch), this replica's micro-batches of each global batch from ``batch`` on."""
        self._start[:] = [epoch, batch, *(micro_batches or (0, 0, 0))]

    def _worker(self) -> tuple[int, int, int, int]:
        """(worker id, workers, start epoch, start batch) in the current process."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return worker, workers, int(self._start[0]), int(self._start[1])

    def _micro_batches(self) -> tuple[int, int, int] | None:
        """(replica, live replicas, micro-batches) in survivor mode, else None."""
        rank, members, micro_batches = (int(v) for v in self._start[2:])
        return (rank, members, micro_batches) if members else None

    def _get_prefetcher(self) -> Prefetcher:
        if self._prefetcher is None:  # one per process, kept across epochs (persistent workers)
            streaming = self.streaming
            cache = FileCache(self.cache_dir, streaming.cache_limit)
            self._prefetcher = Prefetcher(self.volume, cache, streaming.prefetch_threads, streaming.prefetch_files,
                                          streaming.prefetch_bytes, self._count_retry)
            if get_worker_info() is not None:
                # A worker's heap is mostly what its imports made (torch, torchvision, pyarrow,
                # botocore). A full collection traverses all of it holding the GIL, about 0.3 s
                # here, stalling decodes and downloads alike, a few times an epoch: keep those
                # objects out of collections (the worker runs the dataset alone).
                gc.freeze()
        return self._prefetcher

    def _sample(self, data: torch.Tensor, name: str, epoch: int, sample_id: int) -> torch.Tensor | None:
        """Decode and augment one sample, its randomness seeded from (seed, epoch, sample id).

        None for a sample that does not decode when ``skip_corrupt``; else CorruptSampleError.
        """
        info = get_worker_info()
        self._samples_read[(info.id if info is not None else 0) % READ_COUNTER_SLOTS] += 1
        try:
            image = decode_image(data, mode=ImageReadMode.RGB)
        except RuntimeError as err:
            if not self.skip_corrupt:
                raise CorruptSampleError(f"cannot decode {self.volume.uri}/{name}: {err}") from err
            logger.warning("skipping corrupt sample %s/%s", self.volume.uri, name)
            return None
        # The CPU generator only: torch.manual_seed also queues a lazy CUDA seeding, which
        # captures a stack trace on every call (~0.5 ms, more than decoding a small JPEG).
        seed = derive_seed(self.seed, epoch, sample_id)
        if info is not None:  # a worker process: its generator serves this alone
            torch.default_generator.manual_seed(seed)
            return self.transform(image)
        with torch.random.fork_rng(devices=[]):  # num_workers=0: keep the training loop's stream
            torch.default_generator.manual_seed(seed)
            return self.transform(image)

    def _worker_batch(self, samples: list[tuple[int, torch.Tensor | None, int]], number: int,
                      part: int = 0) -> WorkerBatch:
        """A batch (micro-batch ``part``) from (sample id, image or None if skipped, label) triples."""
        kept = [(i, image, label) for i, image, label in samples if image is not None]
        batch = Batch(
            # default_collate stacks straight into shared memory in a DataLoader worker: a plain
            # torch.stack would be copied there once more on its way to the main process.
            default_collate([image for _, image, _ in kept]) if kept else torch.empty(0),
            torch.tensor([label for _, _, label in kept], dtype=torch.long),
            torch.tensor([i for i, _, _ in kept], dtype=torch.long),
            number,
            part,
        )
        return WorkerBatch(batch, self._cache_delta(), len(samples) - len(kept))

    def _cache_delta(self) -> CacheStats:
        stats = self._get_prefetcher().cache.stats
        delta = CacheStats(stats.hits - self._reported.hits, stats.misses - self._reported.misses,
                           stats.bytes_downloaded - self._reported.bytes_downloaded,
                           stats.download_seconds - self._reported.download_seconds)
        self._reported = CacheStats(stats.hits, stats.misses, stats.bytes_downloaded, stats.download_seconds)
        return delta

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_prefetcher"] = None  # threads do not cross processes; each worker makes its own
        return state


class VolumeImageDataset(StreamingVolumeDataset):
    """Image files of a :class:`Volume` in the deterministic global order of a :class:`SamplePlan`.

    Args (besides :class:`StreamingVolumeDataset`'s):
        world_size: the number of ranks (Ray Train's world size).
        drop_last: drop the epoch's tail that does not fill a global batch (True), or pad the
            last batch by repeating samples from the epoch's start (False).
    """

    def __init__(
        self,
        volume: Volume,
        *,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drop_last: bool = True,
        streaming: StreamingConfig = StreamingConfig(),
        skip_corrupt: bool = False,
    ):
        super().__init__(volume, global_batch=global_batch, rank=rank, seed=seed, transform=transform,
                         streaming=streaming, skip_corrupt=skip_corrupt)
        self.plan = SamplePlan(len(volume.files), global_batch, world_size, seed, drop_last)

    def batches_per_epoch(self, epoch: int) -> int:
        return self.plan.batches_per_epoch

    def check_workers(self, num_workers: int) -> None:
        self.plan.check_workers(num_workers)

    def __iter__(self) -> Iterator[WorkerBatch]:
        worker, workers, epoch, start = self._worker()
        prefetcher = self._get_prefetcher()
        prefetcher.restart(self._sample_stream(epoch, worker, workers, start))
        for number, part, indices in self._worker_items(epoch, worker, workers, start):
            samples = []
            for sample in indices.tolist():
                file = self.volume.files[sample]
                data = prefetcher.read(sample, read_bytes)
                samples.append((sample, self._sample(data, file.path, epoch, sample), file.label))
            yield self._worker_batch(samples, number, part)

    def _worker_items(self, epoch: int, worker: int, workers: int, start: int) -> list[tuple[int, int, np.ndarray]]:
        """(global batch, micro-batch, sample indices) this worker serves of ``epoch`` from batch
        ``start``: the rank's share of each global batch, or in survivor mode the replica's
        micro-batches; the loader takes its workers' items round-robin."""
        micro_batches = self._micro_batches()
        if micro_batches is None:
            return [(number, 0, indices)
                    for number, indices in self.plan.worker_batches(epoch, self.rank, worker, workers, start)]
        rank, members, parts = micro_batches
        return self.plan.micro_batch_items(epoch, parts, rank, members, start)[worker::max(workers, 1)]

    def _sample_stream(self, epoch: int, worker: int, workers: int, start: int) -> Iterator[int]:
        """This worker's samples in plan order, from (epoch, start) on into the following epochs."""
        for e in itertools.count(epoch):
            for _number, _part, indices in self._worker_items(e, worker, workers, start if e == epoch else 0):
                yield from indices.tolist()
