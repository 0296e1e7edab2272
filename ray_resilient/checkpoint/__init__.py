"""Sharded asynchronous DCP checkpoints reported through Ray Train, with automatic resume.

The names in ``__all__`` are the public API; the modules behind them are internal and may change.
"""

from ray_resilient._lazy import lazy_exports

_EXPORTS = {
    "UnrecoverableRunError": "errors",
    "CheckpointDir": "layout",
    "is_complete": "layout",
    "list_checkpoints": "layout",
    "RunLeaseHeldError": "lease",
    "RunLeaseLostError": "lease",
    "Checkpointer": "checkpointer",
    "CheckpointSaveError": "checkpointer",
    "IncompatibleCheckpointError": "restore",
    "NoLoadableCheckpointError": "restore",
    "ReshardableStateful": "state",
    "TrainState": "state",
    "CheckpointStorage": "storage",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
