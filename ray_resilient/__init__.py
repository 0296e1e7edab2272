"""ray_resilient: fast, fault-tolerant PyTorch training on Ray Train."""

from ray_resilient.checkpoint import (
    CheckpointManager,
    CheckpointSaveError,
    CheckpointStorage,
    IncompatibleCheckpointError,
    NoLoadableCheckpointError,
    ReshardableStateful,
    RunLeaseHeldError,
    RunLeaseLostError,
    TrainState,
    UnrecoverableRunError,
    list_checkpoints,
)
from ray_resilient.faults import FaultInjector, InjectedFault, parse_faults, random_kill_plan
from ray_resilient.ray_config import ResilientRayConfig, RunFailedError, recommended_ray_config

__all__ = [
    "CheckpointManager",
    "CheckpointSaveError",
    "CheckpointStorage",
    "FaultInjector",
    "IncompatibleCheckpointError",
    "InjectedFault",
    "NoLoadableCheckpointError",
    "ReshardableStateful",
    "RunLeaseHeldError",
    "RunLeaseLostError",
    "TrainState",
    "UnrecoverableRunError",
    "list_checkpoints",
    "parse_faults",
    "random_kill_plan",
    "recommended_ray_config",
    "ResilientRayConfig",
    "RunFailedError",
]
