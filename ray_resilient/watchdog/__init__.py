"""Hang detection for the whole-group path: a rank that stops making progress costs seconds.

Each rank reports its progress (:mod:`.progress`) to a watchdog actor outside every rank
(:mod:`.monitor`), which kills a rank that went silent (stopped, its node lost) or that answers but
made no progress for longer than it is allowed, so that Ray Train restarts the worker group as for
a crash; a rank that dies is no hang (Ray restarts the group for it). The
:class:`~ray_resilient.Checkpointer` runs it as a lifecycle hook (:mod:`.hook`;
``CheckpointConfig(hang_watchdog=HangWatchdogConfig())``, the default).

The names in ``__all__`` are the public API; the modules behind them are internal and may change.
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.watchdog.progress import HangWatchdogConfig

_EXPORTS = {
    "HangWatchdogConfig": "progress",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
