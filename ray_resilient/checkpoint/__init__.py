"""Sharded asynchronous DCP checkpoints reported through Ray Train, with automatic resume.

The names in ``__all__`` are the stable API, those in ``DEVELOPER`` the developer API; the modules
behind them are internal and may change.
``SavePolicy`` is the rule the ``Checkpointer`` saves by, for loops that checkpoint another way
(the naive baseline of ``benchmarks/goodput_chaos.py``).
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.checkpoint.checkpointer import Checkpointer
    from ray_resilient.checkpoint.config import CheckpointConfig
    from ray_resilient.checkpoint.errors import UnrecoverableRunError
    from ray_resilient.checkpoint.layout import CheckpointDir, is_complete, list_checkpoints
    from ray_resilient.checkpoint.lease import RunLeaseHeldError, RunLeaseLostError
    from ray_resilient.checkpoint.loop import CheckpointStatus
    from ray_resilient.checkpoint.restore import IncompatibleCheckpointError, NoLoadableCheckpointError
    from ray_resilient.checkpoint.save_outcomes import CheckpointSaveError
    from ray_resilient.checkpoint.save_policy import SavePolicy
    from ray_resilient.checkpoint.state import ReshardableStateful, TrainState
    from ray_resilient.checkpoint.storage import CheckpointStorage

_EXPORTS = {
    "UnrecoverableRunError": "errors",
    "RunLeaseHeldError": "lease",
    "RunLeaseLostError": "lease",
    "Checkpointer": "checkpointer",
    "CheckpointConfig": "config",
    "CheckpointStatus": "loop",
    "CheckpointSaveError": "save_outcomes",
    "IncompatibleCheckpointError": "restore",
    "NoLoadableCheckpointError": "restore",
    "TrainState": "state",
    "CheckpointStorage": "storage",
}
DEVELOPER = {  # for code that extends the library: may change between minor versions
    "CheckpointDir": "layout",
    "is_complete": "layout",
    "list_checkpoints": "layout",
    "SavePolicy": "save_policy",
    "ReshardableStateful": "state",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS | DEVELOPER)
