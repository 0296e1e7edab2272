"""Survivor mode's Ray Train backend: replica groups of one worker, and the membership coordinator.

A backend with replica groups (:func:`~ray_resilient._ray_internals.with_replica_groups`) tells
Ray Train 2.60's controller to replace only the workers that failed, leaving the others running
(the mechanism Ray built for torchft). It sets up no torch process group: the replicas form their
own gloo groups per membership.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.train.backend import Backend
from ray.train.torch import TorchConfig
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_resilient._ray_internals import is_replica_group, with_replica_groups
from ray_resilient.survivors.coordinator import MembershipCoordinator

_coordinator: Any = None  # in a worker process: its worker group's coordinator


def coordinator() -> Any:
    """The membership coordinator of this worker's group (inside a survivor-mode train function)."""
    if _coordinator is None:
        raise RuntimeError("SurvivingReplicas runs only in a TorchTrainer configured with "
                           "torch_config=SurvivorConfig() (recommended_ray_config(..., survivors=True))")
    return _coordinator


def _set_coordinator(handle: Any) -> None:
    global _coordinator
    _coordinator = handle


@with_replica_groups
class _SurvivorBackend(Backend):
    def __init__(self) -> None:
        self._coordinator: Any = None

    def on_start(self, worker_group: Any, backend_config: "SurvivorConfig") -> None:
        """A whole worker group starting gets a new coordinator; a replacement joins the current one."""
        replacing = is_replica_group(worker_group)
        if self._coordinator is None or not replacing:
            if self._coordinator is not None:
                ray.kill(self._coordinator)
            self._coordinator = MembershipCoordinator.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False)).remote(len(worker_group))
        worker_group.execute(_set_coordinator, self._coordinator)


class SurvivorConfig(TorchConfig):
    """``TorchTrainer(torch_config=SurvivorConfig())``: survivor mode (see
    :class:`~ray_resilient.survivors.SurvivingReplicas`); CPU or GPU workers, gloo between replicas."""

    @property
    def backend_cls(self) -> type[Backend]:
        return _SurvivorBackend
