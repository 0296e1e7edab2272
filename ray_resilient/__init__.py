"""ray_resilient: fast, fault-tolerant PyTorch training on Ray Train.

Public: the names in ``__all__`` here and in ``checkpoint``, ``data`` and ``goodput``, plus
``ray_resilient.testing`` (the rig, for running our chaos tools against your jobs) and the
``ray-resilient`` command. Modules with a leading underscore, and the modules behind the
exported names, are internal. Names are imported on first use (:mod:`ray_resilient._lazy`):
``import ray_resilient`` alone imports neither torch nor Ray.
"""

from ray_resilient._lazy import lazy_exports

_EXPORTS = {
    "Checkpointer": "checkpoint",
    "CheckpointSaveError": "checkpoint",
    "CheckpointStorage": "checkpoint",
    "IncompatibleCheckpointError": "checkpoint",
    "NoLoadableCheckpointError": "checkpoint",
    "ReshardableStateful": "checkpoint",
    "RunLeaseHeldError": "checkpoint",
    "RunLeaseLostError": "checkpoint",
    "TrainState": "checkpoint",
    "UnrecoverableRunError": "checkpoint",
    "list_checkpoints": "checkpoint",
    "FaultInjector": "faults",
    "InjectedFault": "faults",
    "parse_faults": "faults",
    "random_kill_plan": "faults",
    "RayUnreachableError": "connect",
    "connect_ray": "connect",
    "ResilientRayConfig": "ray_config",
    "RunFailedError": "ray_config",
    "recommended_ray_config": "ray_config",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
