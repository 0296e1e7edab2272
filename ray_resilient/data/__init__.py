"""Stream, cache, shard and prefetch files from a remote volume, with an exact resumable position.

The names in ``__all__`` are the public API; the modules behind them are internal and may change.
"""

from ray_resilient._lazy import lazy_exports

_EXPORTS = {
    "CacheStats": "cache",
    "FileCache": "cache",
    "StreamingConfig": "config",
    "Batch": "dataset",
    "CorruptSampleError": "dataset",
    "StreamingVolumeDataset": "dataset",
    "VolumeImageDataset": "dataset",
    "default_cache_dir": "dataset",
    "default_transform": "dataset",
    "eval_transform": "dataset",
    "VolumeDataLoader": "loader",
    "default_num_workers": "loader",
    "PARQUET_STREAMING": "parquet",
    "ParquetVolumeDataset": "parquet",
    "SamplePlan": "plan",
    "Volume": "volume",
    "VolumeError": "volume",
    "VolumeFile": "volume",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
