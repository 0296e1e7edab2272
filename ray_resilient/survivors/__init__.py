"""Survivor mode: when a replica dies the others keep training in their processes, and a
replacement copies its state from a live replica.

The choice: Ray Train's replica-group replacement, without torchft. Ray 2.60's controller
replaces only the failed workers of a backend with ``has_replica_groups`` (built for its
``TorchftConfig``); that part carries the weight and :class:`SurvivorConfig` uses it. Above it,
torchft does not, for three reasons:

- It did not recover here. Ray's own example as shipped (``torchft_linear_example.py``: 2
  workers, ``error_step=20``, ``TorchftConfig(lighthouse_kwargs={"min_replicas": 1})``,
  ``max_failures=3``; torchft 0.2.0, Ray 2.60, 2 cores, 2026-12-01): Ray replaced the failed
  replica, then every attempt's quorum request to the Lighthouse ended in "Timeout expired"
  until ``max_failures`` was used up, 257 s in all, the run failed.
- Its data sampler is lossy by design: the batches a dead replica group was given are never
  trained, and a recovered one ends a batch behind. Here a dropped step's global batch is
  trained again, whole, by the replicas that remain.
- Its reductions depend on who is alive, so a run that lost a replica is not the run that did
  not. Here each micro-batch's gradient is its own row of the step's exchange, which adds the
  rows in micro-batch order: the result is bitwise that of an uninterrupted run.

What replaces torchft is small: a :class:`~ray_resilient.survivors.coordinator.MembershipCoordinator`
actor (membership, liveness by TCP connection, the gloo rendezvous store), a gloo group per
membership, and the state copy of a replacement by broadcast from a live replica.

The names in ``__all__`` are the public API; the modules behind them are internal and may change.
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.survivors.backend import SurvivorConfig
    from ray_resilient.survivors.coordinator import Membership
    from ray_resilient.survivors.replicas import SurvivingReplicas

_EXPORTS = {
    "SurvivorConfig": "backend",
    "SurvivingReplicas": "replicas",
    "Membership": "coordinator",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
