"""Stream, cache, shard and prefetch files from a remote volume, with an exact resumable position."""

from ray_resilient.data.cache import CacheStats, FileCache
from ray_resilient.data.dataset import (
    Batch,
    CorruptSampleError,
    StreamingVolumeDataset,
    VolumeImageDataset,
    default_cache_dir,
    default_transform,
    eval_transform,
)
from ray_resilient.data.loader import VolumeDataLoader, default_num_workers
from ray_resilient.data.parquet import ParquetVolumeDataset
from ray_resilient.data.plan import SamplePlan
from ray_resilient.data.volume import Volume, VolumeError, VolumeFile

__all__ = [
    "Batch",
    "CacheStats",
    "CorruptSampleError",
    "FileCache",
    "ParquetVolumeDataset",
    "SamplePlan",
    "StreamingVolumeDataset",
    "Volume",
    "VolumeDataLoader",
    "VolumeError",
    "VolumeFile",
    "VolumeImageDataset",
    "default_cache_dir",
    "default_num_workers",
    "default_transform",
    "eval_transform",
]
