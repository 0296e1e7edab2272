"""How a run checkpoints: one frozen, validated set of knobs that both modes take (the mainline's
:class:`~ray_resilient.Checkpointer` and survivor mode's :class:`~ray_resilient.survivors.SurvivingReplicas`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ray_resilient.checkpoint.lease import TTL_S
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.tracking import MetricsLogger, check_metrics_logger
from ray_resilient.watchdog.progress import HangWatchdogConfig


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When and how checkpoints are made, and what watches the loop. Invalid values raise
    ``ValueError`` at construction, naming the knob.

    Args:
        interval_steps, mtbf_s, preemption_check_steps: when to save (a
            :class:`~ray_resilient.checkpoint.save_policy.SavePolicy`): every this many steps (each
            save stalls the loop only for the staging copy, so short intervals are cheap; lost work
            per failure is about half an interval), ``"auto"`` (Daly's interval for the job's
            ``mtbf_s`` from the measured save stall and step time), or None (only the final save
            and preemption saves). Every ``preemption_check_steps`` steps Ray is asked for an
            imminent preemption, which a just-in-time save answers.
        seed: the run's seed, recorded, and used to re-derive RNG streams (after a resize; in
            survivor mode, per micro-batch).
        staging_buffers: sets of reused host buffers for staging (each holds this rank's share of
            the state: pinned memory on GPU). With 2, a save starts while the previous one is still
            being written; when every set is still being written, a due save is deferred (one step
            at a time, counted) instead of waiting. 1 halves the memory.
        write_threads: files each rank writes in parallel (DCP's ``thread_count``), each uploaded in
            parallel to remote storage.
        save_timeout_s: a save still writing this long after it began holds up the saves due after
            it no more: each fails (counting towards ``max_failed_saves_in_a_row``), and waiting for
            it (the final save) raises ``CheckpointSaveError``.
        lease_ttl_s: how long the run directory's lease (one driver per run) may go unrenewed before
            a driver started again takes it over.
        max_failed_saves_in_a_row: after this many saves in a row failed, raise
            ``CheckpointSaveError`` (the attempt fails and Ray's ``FailureConfig`` restarts it)
            instead of training on with nothing durable. A failed save alone is logged, counted and
            retried at the next interval; a failed final save is made again from memory.
        storage: where checkpoints go; defaults to the Ray run's storage.
        faults: a fault-injection plan (:mod:`ray_resilient.faults`); defaults to the
            ``RAY_RESILIENT_FAULTS`` environment variable, normally unset (no faults).
        goodput_logger, goodput_log_every: where rank 0 logs the run's live goodput every this many
            steps: ``"mlflow"`` (the MLflow run of this Ray Train run, metrics ``goodput/...``), a
            callable ``(metrics, step)``, or None. The goodput ledger itself is always kept.
        hang_watchdog: when a rank of the mainline is declared hung, killed, and the worker group
            restarted (:mod:`ray_resilient.watchdog`). A rank that sends no heartbeat (stopped, its
            node lost): after 2 s of silence, more where the run's heartbeats arrive late. A rank that
            answers but makes no progress: by default after ``max(60 s, 10 x`` the p99 of its recent
            steps' longest stretch without progress``)``; 600 s for the restore, the first 3 steps, the
            first save's staging and each ``torch.compile`` compilation; a later save's staging: 10 x
            the one before's, if more; waiting for a save to become durable (a preemption save, the
            final save, closing): ``save_timeout_s`` more. Progress: the forward and backward of the
            model's modules, each tensor a save stages, each file or chunk a restore verifies or
            fetches, each sample the data loader reads and each failed read it retries, each step and
            ``progress(phase)``. At a step where an earlier attempt was declared hung, the allowance
            doubles. None: only Ray's worker health check (``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S``).
            Survivor mode drops a replica that stops answering by its own liveness link instead.
    """

    interval_steps: int | Literal["auto"] | None = 100
    mtbf_s: float | None = None
    preemption_check_steps: int = 10
    seed: int = 0
    staging_buffers: int = 2
    write_threads: int = 4
    save_timeout_s: float = 600.0
    lease_ttl_s: float = TTL_S
    max_failed_saves_in_a_row: int = 3
    storage: CheckpointStorage | None = None
    faults: str | None = None
    goodput_logger: MetricsLogger | str | None = "mlflow"
    goodput_log_every: int = 50
    hang_watchdog: HangWatchdogConfig | None = HangWatchdogConfig()

    def __post_init__(self) -> None:
        interval = self.interval_steps
        if interval == "auto":
            if self.mtbf_s is None or not self.mtbf_s > 0:
                raise ValueError(f'interval_steps="auto" needs the job\'s mtbf_s (seconds, > 0), got {self.mtbf_s!r}')
        elif interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f'interval_steps must be an int >= 1, "auto" or None, got {interval!r}')
        for name in ("preemption_check_steps", "staging_buffers", "write_threads", "max_failed_saves_in_a_row",
                     "goodput_log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_metrics_logger(self.goodput_logger, "goodput_logger")
        for name in ("save_timeout_s", "lease_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.storage is not None and not isinstance(self.storage, CheckpointStorage):
            raise ValueError(f"storage must be a CheckpointStorage (CheckpointStorage.from_uri(...)), "
                             f"got {type(self.storage).__name__}")

    def replace(self, **changes) -> "CheckpointConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
