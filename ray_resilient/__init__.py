"""ray_resilient: fast, fault-tolerant PyTorch training on Ray Train."""

from ray_resilient.checkpoint import (
    CheckpointManager,
    CheckpointSaveError,
    CheckpointStorage,
    ReshardableStateful,
    TrainState,
    list_checkpoints,
)
from ray_resilient.faults import FaultInjector, InjectedFault, parse_faults

__all__ = [
    "CheckpointManager",
    "CheckpointSaveError",
    "CheckpointStorage",
    "FaultInjector",
    "InjectedFault",
    "ReshardableStateful",
    "TrainState",
    "list_checkpoints",
    "parse_faults",
]
