"""Where a volume dataset caches its files and how far ahead each worker downloads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamingConfig:
    """The cache and prefetch knobs of a volume dataset, checked once here.

    The defaults suit one sample per file (:class:`VolumeImageDataset`); Parquet files hold many
    samples each, so :class:`ParquetVolumeDataset` defaults to ``PARQUET_STREAMING``: start from
    it to change one knob (``dataclasses.replace(PARQUET_STREAMING, cache_limit=...)``).

    Args:
        cache_dir: local cache directory, shared by every process on the node (None:
            :func:`default_cache_dir`, so a restarted job on the node finds its files).
        cache_limit: bound on the cache's bytes (None: unbounded). It must hold every prefetch
            window on the node at once, so at least ``prefetch_bytes``.
        prefetch_files, prefetch_bytes: each worker's prefetch window (it always holds one file).
            Larger hides more download latency, at the cost of memory and cache pressure.
        prefetch_threads: concurrent downloads per worker (latency hiding for remote volumes).
    """

    cache_dir: str | None = None
    cache_limit: int | None = None
    prefetch_files: int = 64
    prefetch_bytes: int = 256 << 20
    prefetch_threads: int = 8

    def __post_init__(self) -> None:
        if self.cache_dir == "":
            raise ValueError("cache_dir is empty: pass a directory path, or None for the default per volume")
        if self.cache_limit is not None:
            _check_positive("cache_limit", self.cache_limit, "bytes, or None for an unbounded cache")
        _check_positive("prefetch_files", self.prefetch_files, "files")
        _check_positive("prefetch_bytes", self.prefetch_bytes, "bytes")
        _check_positive("prefetch_threads", self.prefetch_threads, "download threads per worker")
        if self.cache_limit is not None and self.cache_limit < self.prefetch_bytes:
            raise ValueError(
                f"cache_limit ({self.cache_limit} bytes) is smaller than the prefetch window "
                f"({self.prefetch_bytes} bytes): raise cache_limit or lower prefetch_bytes"
            )


def _check_positive(name: str, value: object, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive number of {unit}; got {value!r}")
