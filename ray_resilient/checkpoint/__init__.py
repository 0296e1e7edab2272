"""Sharded asynchronous DCP checkpoints reported through Ray Train, with automatic resume."""

from ray_resilient.checkpoint.errors import UnrecoverableRunError
from ray_resilient.checkpoint.layout import CheckpointDir, is_complete, list_checkpoints
from ray_resilient.checkpoint.lease import RunLeaseHeldError, RunLeaseLostError
from ray_resilient.checkpoint.manager import CheckpointManager, CheckpointSaveError
from ray_resilient.checkpoint.restore import IncompatibleCheckpointError, NoLoadableCheckpointError
from ray_resilient.checkpoint.state import ReshardableStateful, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage

__all__ = [
    "CheckpointDir",
    "CheckpointManager",
    "CheckpointSaveError",
    "CheckpointStorage",
    "IncompatibleCheckpointError",
    "NoLoadableCheckpointError",
    "ReshardableStateful",
    "RunLeaseHeldError",
    "RunLeaseLostError",
    "TrainState",
    "UnrecoverableRunError",
    "is_complete",
    "list_checkpoints",
]
