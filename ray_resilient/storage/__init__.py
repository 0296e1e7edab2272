"""The shared base: a path or URI to a pyarrow filesystem, and a run's storage on it.

The names in ``__all__`` are the public API; the modules behind them are internal and may change.
:func:`open_filesystem` opens a local path, a mount or ``s3://bucket/prefix`` (endpoint and
credentials from ``AWS_*`` variables); :meth:`RunStorage.from_ray_context` is the
current Ray Train run's directory, for files a train function writes beside its checkpoints.
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.storage.run import RunStorage
    from ray_resilient.storage.uri import open_filesystem

_EXPORTS = {
    "RunStorage": "run",
    "open_filesystem": "uri",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
