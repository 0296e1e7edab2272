"""The experiment kit of the chaos benchmarks and tests: unstable, it changes with them, without notice.

Built on the rig (:mod:`ray_resilient.testing`): one record format for what each process did
(:mod:`.records`), the job and its train loops in Ray's workers (:mod:`.chaos_job`), seeded kill
plans, the driver and the analyses (:mod:`.experiment`). Only ``benchmarks/`` and ``tests/`` may
use it (``tests/test_layering.py``); a job of yours should not.
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.testing.kit.chaos_job import (
        ChaosJob, Worker, job_model, train_replica, train_restarting, train_survivors,
    )
    from ray_resilient.testing.kit.experiment import (
        PHASES, RESTART_DETAIL, SETUP_MARKS, Fit, Kill, Pause, chaos_cluster, committed_micro_batches, discarded_steps,
        experiment_dir, finite_median, fit_on, foreign_cpu, kept_samples, kill_moments, median_step_seconds,
        planned_samples, recovery_phases, sample_errors, spaced_kill_plan, start_local_ray, survivor_pauses,
        timed_kill_schedule,
    )
    from ray_resilient.testing.kit.records import RecordKind, Recorder, of_kind, read_records

_EXPORTS = {
    "ChaosJob": "chaos_job",
    "Worker": "chaos_job",
    "job_model": "chaos_job",
    "train_replica": "chaos_job",
    "train_restarting": "chaos_job",
    "train_survivors": "chaos_job",
    "RecordKind": "records",
    "Recorder": "records",
    "of_kind": "records",
    "read_records": "records",
    "PHASES": "experiment",
    "RESTART_DETAIL": "experiment",
    "SETUP_MARKS": "experiment",
    "Fit": "experiment",
    "Kill": "experiment",
    "Pause": "experiment",
    "chaos_cluster": "experiment",
    "committed_micro_batches": "experiment",
    "discarded_steps": "experiment",
    "experiment_dir": "experiment",
    "finite_median": "experiment",
    "fit_on": "experiment",
    "foreign_cpu": "experiment",
    "kept_samples": "experiment",
    "kill_moments": "experiment",
    "median_step_seconds": "experiment",
    "planned_samples": "experiment",
    "recovery_phases": "experiment",
    "sample_errors": "experiment",
    "spaced_kill_plan": "experiment",
    "start_local_ray": "experiment",
    "survivor_pauses": "experiment",
    "timed_kill_schedule": "experiment",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
