"""The shared base: a path or URI to a pyarrow filesystem, and a run's storage on it."""

from ray_resilient.storage.run import RunStorage
from ray_resilient.storage.uri import open_filesystem

__all__ = ["RunStorage", "open_filesystem"]
