"""Stream, cache, shard and prefetch files from a remote volume, with an exact resumable position.

The names in ``__all__`` are the stable API, those in ``DEVELOPER`` the developer API; the modules
behind them are internal and may change.
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.data.cache import CacheStats, FileCache
    from ray_resilient.data.config import StreamingConfig
    from ray_resilient.data.dataset import (
        Batch, CorruptSampleError, StreamingVolumeDataset, VolumeImageDataset, default_cache_dir, default_transform,
        eval_transform,
    )
    from ray_resilient.data.loader import VolumeDataLoader, default_num_workers
    from ray_resilient.data.parquet import PARQUET_STREAMING, ParquetVolumeDataset
    from ray_resilient.data.plan import SamplePlan
    from ray_resilient.data.volume import Volume, VolumeError, VolumeFile

_EXPORTS = {
    "StreamingConfig": "config",
    "Batch": "dataset",
    "CorruptSampleError": "dataset",
    "VolumeImageDataset": "dataset",
    "default_transform": "dataset",
    "eval_transform": "dataset",
    "VolumeDataLoader": "loader",
    "PARQUET_STREAMING": "parquet",
    "ParquetVolumeDataset": "parquet",
    "Volume": "volume",
    "VolumeError": "volume",
}
DEVELOPER = {  # for code that extends the library: may change between minor versions
    "CacheStats": "cache",
    "FileCache": "cache",
    "StreamingVolumeDataset": "dataset",
    "default_cache_dir": "dataset",
    "default_num_workers": "loader",
    "SamplePlan": "plan",
    "VolumeFile": "volume",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS | DEVELOPER)
