"""Spare worker processes, started and warmed before a failure, for the restarted worker group.

After a failure Ray Train replaces the whole worker group with new actors, and each new actor is
a new Python process: Ray's worker starts, then imports torch, Ray Train and the train
function's modules. On a busy node that is most of a recovery (``benchmarks/recovery.py``).
Ray's worker pool gives a new actor an idle worker process of the same job and runtime
environment when one is there. So once an attempt has completed its first step, local rank 0
of each node asks its raylet (Ray's ``PrestartWorkers`` RPC) for as many idle workers as the
node runs ranks, with this worker's runtime environment, exempt from Ray's idle-worker reaper
for :data:`KEEP_ALIVE_S`. Each
of them imports the preload modules as it starts (Ray's worker process setup hook, set through
``RunConfig(worker_runtime_env=...)`` by :func:`worker_env`). The next restart's actors take
them and start in a fraction of a second; their replacements are asked for once that attempt
trains.

Costs: every spare is an idle process with torch, Ray Train and ray_resilient imported (about
0.7 GB of host memory), and starting one takes a few CPU seconds on the node while training goes
on. Each attempt asks once, and the next restart consumes them, so a node keeps one spare per
rank; spares end with the job. This uses Ray internals (the RPC and the setup hook's environment
variable, both in :mod:`ray_resilient._ray_internals`); when one moved or the request fails, a
warning is logged and training goes on without spares.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from collections.abc import Sequence

from ray_resilient._ray_internals import prestart_workers, worker_setup_hook_env_var
from ray_resilient.lifecycle import LifecycleHook

logger = logging.getLogger(__name__)

SPARE_WORKERS_ENV = "RAY_RESILIENT_SPARE_WORKERS"  # "1": Checkpointer asks for spares; "0" on a driver: none
PRELOAD_ENV = "RAY_RESILIENT_PRELOAD_MODULES"  # comma-separated modules a spare imports at start
# MLflow: where the Checkpointer's goodput and the loader's metrics go by default (seconds to import).
DEFAULT_PRELOAD_MODULES = ("torch", "ray.train.torch", "ray_resilient", "mlflow")
KEEP_ALIVE_S = 24 * 3600  # Ray's idle-worker reaper leaves a spare alone this long (then keeps up to num_cpus idle)
_SETUP_HOOK = f"{__name__}.preload_modules"

preloaded: list[str] = []  # modules this process imported through preload_modules()


def worker_env(preload: Sequence[str] = DEFAULT_PRELOAD_MODULES, cpus_per_worker: float = 1) -> dict[str, str]:
    """Environment for Ray Train's workers: spares on, and every worker process imports ``preload`` at start.

    It also sets ``OMP_NUM_THREADS`` as Ray would for a worker with ``cpus_per_worker`` CPUs (at
    least 1): Ray sets it when the worker's actor starts, after the preload has imported torch,
    which sizes its thread pool from it.
    """
    for name in preload:
        if not name or "," in name:
            raise ValueError(f"preload module names must be non-empty and without commas, got {name!r}")
    env = {SPARE_WORKERS_ENV: "1", PRELOAD_ENV: ",".join(preload),
           "OMP_NUM_THREADS": str(max(math.floor(cpus_per_worker), 1))}
    hook_env_var = worker_setup_hook_env_var()
    if hook_env_var is not None:
        env[hook_env_var] = _SETUP_HOOK
    return env


def preload_modules() -> None:
    """Ray's worker process setup hook: import the modules named in ``RAY_RESILIENT_PRELOAD_MODULES``.

    A module that fails to import is logged and skipped: the worker must still start.
    """
    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        try:
            importlib.import_module(name)
            preloaded.append(name)
        except Exception:  # noqa: BLE001 - a failing preload must not kill the worker process
            logger.warning("Could not preload %s in a Ray worker", name, exc_info=True)


def helper_runtime_env() -> dict[str, dict[str, str]]:
    """The runtime environment of a helper actor a train worker starts (the hang watchdog): it
    would inherit the worker's, and with it the preload (torch, Ray Train: seconds before it
    answers, in every restart); with this its process imports only what it uses."""
    return {"env_vars": {PRELOAD_ENV: ""}}


def spares_by_default() -> bool:
    """Whether a driver asks for spares when its configuration does not say: yes, unless its
    environment sets ``RAY_RESILIENT_SPARE_WORKERS=0`` (few cores, which the spares' imports would
    take from training; a run no restart follows)."""
    return os.environ.get(SPARE_WORKERS_ENV, "1") != "0"


def spares_enabled() -> bool:
    """Whether this worker was configured to ask for spares (see :func:`worker_env`)."""
    return os.environ.get(SPARE_WORKERS_ENV) == "1"


class SpareWorkerRequest(LifecycleHook):
    """A lifecycle hook (:class:`~ray_resilient.lifecycle.LifecycleHook`): once this process trained
    its first step, local rank 0 of each node asks for one spare per rank of the node."""

    def __init__(self) -> None:
        self._asked = False

    def step_finished(self, step: int) -> None:
        if self._asked:
            return
        self._asked = True
        import ray.train

        context = ray.train.get_context()
        if context.get_local_rank() == 0:
            start_spare_workers(context.get_local_world_size())


def start_spare_workers(count: int, keep_alive_s: int = KEEP_ALIVE_S) -> bool:
    """Ask this node's raylet for ``count`` idle workers of this job with this worker's runtime env.

    Call from inside a Ray worker. Returns whether the raylet accepted the request (a warning
    is logged when not: training goes on without spares).
    """
    return prestart_workers(count, keep_alive_s)
