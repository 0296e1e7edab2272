"""The recommended Ray Train configuration for a run that survives failures, in one call.

::

    config = recommended_ray_config("resnet-imagenet", "s3://bucket/runs", workers=(2, 8), use_gpu=True)
    trainer = TorchTrainer(train_fn, train_loop_config=..., **config.trainer_kwargs())
    result = config.fit(trainer)  # trainer.fit(), with a clear error once max_failures is used up

Each choice, and why:

- ``RunConfig(name, storage_path)`` fixed by the caller: a driver started again with the same
  name resumes the same run from its newest complete checkpoint instead of starting a new one.
- ``FailureConfig(max_failures=10)``: a long job on failing hardware restarts many times; each
  restart costs a restore and at most one checkpoint interval of recomputation. Preemptions
  announced by Ray are counted separately (Ray's ``max_preemption_failures``, unlimited).
- ``ScalingConfig(num_workers=(min, max))``: elastic. After a node is lost the job restarts at
  once on the workers that remain (at least ``min``) instead of waiting for a replacement, and
  grows back to ``max`` when capacity returns. Growing restarts the worker group, so Ray only
  considers it every ``resize_check_s`` (default 5 minutes); a failure restart also grows.
- ``CheckpointConfig(num_to_keep=3)``: the newest checkpoint plus fallbacks in case it turns out
  unreadable; older ones are deleted as new ones are registered.
- The console (:mod:`ray_resilient.console`): the run's story, not Ray's bookkeeping. Ray Train's
  informational logs (``RunConfig(logging_config=LoggingConfig(log_level="WARNING"))``) and the
  raylet's and the Train controller's output are not echoed on the driver (Ray's log files keep
  them); a failure prints one line per failed rank (``ReportFailures``). ``verbose=True`` shows
  everything.
- ``RunConfig(callbacks=[StopOnUnrecoverableError()])``: a checkpoint that does not fit the
  job (it changed: a layer's shape, the dataset), or a run directory another driver holds, fails
  every restart the same way, so the run ends at the first such error
  (:class:`~ray_resilient.UnrecoverableRunError`) instead of spending ``max_failures`` on it;
  :meth:`ResilientRayConfig.fit` raises that error.
- Environment for Ray Train's controller and workers (exported by :meth:`trainer_kwargs`; Ray
  passes it from the driver to them; a value already set in the environment wins):

  - ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.5`` (Ray: 2): the controller notices a dead worker
    within half a second instead of two.
  - ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=10`` (Ray: 60): right after a node is lost, the
    cluster still counts that node's resources until the GCS declares it dead, so the first
    restart may ask for workers that cannot be placed. It is retried with what is really left
    after this timeout instead of a minute later. Startup timeouts are not charged to
    ``max_failures``. On an autoscaling cluster, where new nodes take minutes, keep Ray's 60.
  - ``RAY_TRAIN_ENABLE_PRINT_PATCH=0`` (Ray: 1): Ray Train sends a worker's ``print`` to its
    logger, which writes it to stderr, and, because Ray's worker has replaced ``sys.stdout``, also
    prints it as usual: every line reached the driver twice. Off, a line is printed once.
  - ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S=60`` (Ray: 600): a worker that stops answering
    the controller without dying (SIGSTOP, a hang, a partitioned node) is replaced after a minute
    instead of ten. Raise it if a train function may hold Python's GIL longer (a long C call).

- Spare workers (``spare_workers=True``, or ``RAY_RESILIENT_SPARE_WORKERS=0`` in the driver's
  environment for none): a restart replaces the whole worker group with new
  processes, each starting Ray's worker and importing torch, Ray Train and ray_resilient, most
  of a recovery. Every worker process imports the ``preload`` modules as it starts, and once an
  attempt trains, :class:`~ray_resilient.Checkpointer` asks each node's raylet for as many
  idle processes as the node runs ranks; the next restart's actors take them
  (:mod:`ray_resilient.spare_workers`). Add the train function's heavy imports to ``preload``.

  On the cluster side, the GCS declares a lost node dead after about 15 s of missed health
  checks; the settings ``python -m ray_resilient.testing fast-node-failure-env`` prints shorten
  that to about 3 s (in the head node's environment before ``ray start``).
- Survivor mode (``survivors=True``, a fixed number of workers): a worker's death no longer
  restarts the others. They drop the step in flight and train on among themselves; Ray starts a
  replacement for the dead worker only, which copies its state from a live one. The train function
  uses :class:`~ray_resilient.survivors.SurvivingReplicas` instead of ``Checkpointer``
  (:mod:`ray_resilient.survivors`). Each replacement counts against ``max_failures``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
from ray.train import (
    CheckpointConfig, FailureConfig, LoggingConfig, Result, RunConfig, ScalingConfig, TrainingFailedError,
    UserCallback,
)

from ray_resilient._ray_internals import (
    TRAIN_HEALTH_CHECK_INTERVAL_ENV, TRAIN_PRINT_PATCH_ENV, TRAIN_WORKER_GROUP_START_TIMEOUT_ENV,
    TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_ENV, without_unused_dataset_manager, worker_output_filtered,
)
from ray_resilient.checkpoint.layout import list_checkpoints
from ray_resilient.checkpoint.errors import UnrecoverableRunError
from ray_resilient.console import ReportFailures, shown_lines
from ray_resilient.goodput.events import EventKind
from ray_resilient.goodput.ledger import LedgerWriter
from ray_resilient.storage.run import RunStorage
from ray_resilient.spare_workers import DEFAULT_PRELOAD_MODULES, spares_by_default, worker_env

RECOMMENDED_ENV = {
    TRAIN_HEALTH_CHECK_INTERVAL_ENV: "0.5",
    TRAIN_WORKER_GROUP_START_TIMEOUT_ENV: "10",
    TRAIN_PRINT_PATCH_ENV: "0",
    TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_ENV: "60",
}


class StopOnUnrecoverableError(UserCallback):
    """Ends the run (no restart) when a worker raised an :class:`~ray_resilient.UnrecoverableRunError`."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        for error in worker_exceptions.values():
            if isinstance(error, UnrecoverableRunError):
                raise type(error)(str(error))


class RunFailedError(RuntimeError):
    """The run failed more often than ``max_failures`` allows; its committed checkpoints are kept."""


@dataclass(frozen=True)
class ResilientRayConfig:
    """The Ray Train configuration objects of a resilient run, plus the environment Ray reads."""

    scaling_config: ScalingConfig
    run_config: RunConfig
    env: dict[str, str] = field(default_factory=dict)
    torch_config: Any = None  # survivor mode's SurvivorConfig, else Ray's default
    verbose: bool = False  # echo all of Ray's output on the driver (see ray_resilient.console)

    def trainer_kwargs(self) -> dict[str, Any]:
        """``scaling_config``, ``run_config`` (and survivor mode's ``torch_config``) for
        ``TorchTrainer``; exports :attr:`env` first.

        Ray reads the environment when ``fit()`` starts the controller; variables the user set
        already are left as they are.
        """
        for name, value in self.env.items():
            os.environ.setdefault(name, value)
        kwargs = {"scaling_config": self.scaling_config, "run_config": self.run_config}
        if self.torch_config is not None:
            kwargs["torch_config"] = self.torch_config
        return kwargs

    def fit(self, trainer: Any) -> Result:
        """``trainer.fit()``, recording the driver's start in the run's goodput ledger; a trainer
        without Ray ``datasets`` starts no ``DatasetManager`` actor (Ray starts one for every
        attempt: a process importing Ray Data, about 2 CPU s, on the restart's critical path).

        When Ray gives up on the run, raises :class:`RunFailedError`, which names the exhausted
        ``max_failures``, the last error, and the newest complete checkpoint, which a driver
        started again with the same name and storage path resumes from; when a restart cannot
        help, raises that :class:`~ray_resilient.UnrecoverableRunError` (checkpoints that do not
        fit the job, a run directory another driver holds).
        """
        run = self.run_config
        storage = self._run_storage()
        filesystem, run_dir = storage.filesystem, storage.experiment_path
        ledger = LedgerWriter(storage, rank=-1)
        ledger.record(EventKind.JOB_START)
        ledger.close()
        try:
            with contextlib.nullcontext() if self.verbose else worker_output_filtered(shown_lines):
                return without_unused_dataset_manager(trainer).fit()
        except TrainingFailedError as err:
            failure = getattr(err, "controller_failure", None)
            if isinstance(failure, UnrecoverableRunError):
                raise type(failure)(str(failure)) from err
            complete = [c for c in list_checkpoints(filesystem, run_dir) if c.complete]
            kept = (f"the newest complete checkpoint is {complete[-1].path} (step {complete[-1].step})" if complete
                    else "no checkpoint was completed")
            first_line = str(err).strip().splitlines()[0]
            raise RunFailedError(
                f"run {run.name!r} failed after using up max_failures={run.failure_config.max_failures} restarts "
                f"({first_line} see the error below). Every committed checkpoint is kept: {kept}. Fix the cause and "
                f"start the driver again with the same name and storage path to resume from it."
            ) from err

    def _run_storage(self) -> RunStorage:
        run = self.run_config
        run_dir = f"{run.storage_path.rstrip('/')}/{run.name}"
        if run.storage_filesystem is not None:
            return RunStorage(run.storage_filesystem, run_dir, tempfile.mkdtemp(prefix="ray-resilient-driver-"))
        return RunStorage.from_uri(run_dir, tempfile.mkdtemp(prefix="ray-resilient-driver-"))


def recommended_ray_config(
    name: str,
    storage_path: str,
    *,
    workers: int | tuple[int, int],
    use_gpu: bool = False,
    resources_per_worker: dict[str, float] | None = None,
    max_failures: int = 10,
    num_to_keep: int = 3,
    resize_check_s: float = 300.0,
    storage_filesystem: pafs.FileSystem | None = None,
    env: dict[str, str] | None = None,
    spare_workers: bool | None = None,
    preload: Sequence[str] = DEFAULT_PRELOAD_MODULES,
    survivors: bool = False,
    verbose: bool = False,
) -> ResilientRayConfig:
    """The recommended configuration (see the module docstring for each choice).

    Args:
        name: the run's name; run the driver again with the same name to resume the run.
        storage_path: where checkpoints and the run's records go (a shared path or ``s3://...``).
        workers: ``(min, max)`` workers for an elastic run, or a fixed number.
        use_gpu, resources_per_worker: as in ``ScalingConfig``.
        max_failures: worker-group failures to recover from (-1: unlimited).
        num_to_keep: complete checkpoints kept on storage (at least 2, so one can fall back).
        resize_check_s: how often a running elastic job checks whether it could grow.
        storage_filesystem: a configured pyarrow filesystem for ``storage_path``.
        env: overrides of :data:`RECOMMENDED_ENV`.
        spare_workers: keep warm worker processes for the next restart (default: yes, unless the
            environment sets ``RAY_RESILIENT_SPARE_WORKERS=0``).
        preload: modules every worker process imports as it starts (with ``spare_workers``).
        survivors: survivor mode (:mod:`ray_resilient.survivors`); needs a fixed ``workers``.
        verbose: echo all of Ray's output on the driver, not only the run's story (:mod:`ray_resilient.console`).
    """
    if isinstance(workers, tuple):
        low, high = workers
        if not 1 <= low <= high:
            raise ValueError(f"workers=(min, max) needs 1 <= min <= max, got {workers}")
    elif workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if survivors and isinstance(workers, tuple):
        raise ValueError(f"survivor mode trains on a fixed number of workers (a replacement takes a lost one's "
                         f"place), got workers={workers}: give one number")
    if num_to_keep < 2:
        raise ValueError(f"num_to_keep must be >= 2 so a corrupt newest checkpoint has a fallback, got {num_to_keep}")
    if spare_workers is None:
        spare_workers = spares_by_default()
    scaling = ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources_per_worker,
                            elastic_resize_monitor_interval_s=resize_check_s)
    run = RunConfig(
        name=name,
        storage_path=storage_path,
        storage_filesystem=storage_filesystem,
        failure_config=FailureConfig(max_failures=max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep),
        callbacks=[ReportFailures(), StopOnUnrecoverableError()],
        logging_config=None if verbose else LoggingConfig(log_level="WARNING"),
        worker_runtime_env={"env_vars": worker_env(preload, scaling.num_cpus_per_worker)} if spare_workers else None,
    )
    torch_config = None
    if survivors:
        from ray_resilient.survivors import SurvivorConfig

        torch_config = SurvivorConfig()
    return ResilientRayConfig(scaling, run, {**RECOMMENDED_ENV, **(env or {})}, torch_config, verbose)
