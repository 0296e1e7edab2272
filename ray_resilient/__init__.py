"""ray_resilient: fast, fault-tolerant PyTorch training on Ray Train.

Public: the names of ``ray_resilient``, ``checkpoint``, ``data``, ``goodput``, ``storage``,
``survivors``, ``tracking``, ``watchdog`` and ``testing`` (the rig, for chaos runs of your own
jobs), in three tiers. Stable, what a job uses: each package's ``__all__``. Developer, for code
that extends the library and may change between minor versions: each package's ``DEVELOPER``.
Kit, unstable: ``testing.kit``, the experiment kit of our benchmarks and tests. Every other
module, and the modules behind the exported names, are internal; ``tests/test_layering.py``
holds jobs, examples, notebooks and cluster scripts to stable names and benchmarks to public
ones. Names are imported on first use (:mod:`ray_resilient._lazy`): ``import ray_resilient``
alone imports neither torch nor Ray.
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.checkpoint import (
        CheckpointConfig, Checkpointer, CheckpointSaveError, CheckpointStatus, CheckpointStorage,
        IncompatibleCheckpointError, NoLoadableCheckpointError, ReshardableStateful, RunLeaseHeldError,
        RunLeaseLostError, TrainState, UnrecoverableRunError, list_checkpoints,
    )
    from ray_resilient.connect import RayUnreachableError, connect_ray
    from ray_resilient.faults import FaultInjector, InjectedFault, parse_faults, random_kill_plan
    from ray_resilient.lifecycle import Attempt, LifecycleHook
    from ray_resilient.ray_config import ResilientRayConfig, RunFailedError, recommended_ray_config
    from ray_resilient.spare_workers import DEFAULT_PRELOAD_MODULES

_EXPORTS = {
    "Checkpointer": "checkpoint",
    "CheckpointConfig": "checkpoint",
    "CheckpointStatus": "checkpoint",
    "CheckpointSaveError": "checkpoint",
    "CheckpointStorage": "checkpoint",
    "IncompatibleCheckpointError": "checkpoint",
    "NoLoadableCheckpointError": "checkpoint",
    "RunLeaseHeldError": "checkpoint",
    "RunLeaseLostError": "checkpoint",
    "TrainState": "checkpoint",
    "UnrecoverableRunError": "checkpoint",
    "random_kill_plan": "faults",
    "RayUnreachableError": "connect",
    "connect_ray": "connect",
    "ResilientRayConfig": "ray_config",
    "RunFailedError": "ray_config",
    "recommended_ray_config": "ray_config",
    "DEFAULT_PRELOAD_MODULES": "spare_workers",
}
DEVELOPER = {  # for code that extends the library: may change between minor versions
    "ReshardableStateful": "checkpoint",
    "list_checkpoints": "checkpoint",
    "FaultInjector": "faults",
    "Attempt": "lifecycle",
    "LifecycleHook": "lifecycle",
    "InjectedFault": "faults",
    "parse_faults": "faults",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS | DEVELOPER)
