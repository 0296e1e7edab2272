"""The rig of ray_resilient's tests and benchmarks, for chaos runs of your own jobs too.

A multi-node Ray cluster on one machine whose nodes can really be lost (:class:`LocalRayCluster`),
driver processes that can be killed like real ones (:class:`Driver`), a real S3 server on
loopback (:func:`seaweedfs`), and data to train on (:func:`make_image_volume`,
:class:`SyntheticBatches`). The experiment kit the chaos benchmarks share builds on them
(:mod:`.experiment`): one record format for what each process did (:mod:`.records`), the job
and its train loops (:mod:`.chaos_job`), seeded kill plans, the driver, and the analyses.
``python -m ray_resilient.testing`` is the command line that ``cluster/local.sh`` uses. Names are
imported on first use (:mod:`ray_resilient._lazy`).
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.testing.chaos_job import (
        ChaosJob, Worker, job_model, train_replica, train_restarting, train_survivors,
    )
    from ray_resilient.testing.driver import Driver, DriverError, run_driver
    from ray_resilient.testing.experiment import (
        PHASES, RESTART_DETAIL, SETUP_MARKS, Fit, Kill, Pause, chaos_cluster, committed_micro_batches, discarded_steps,
        experiment_dir, finite_median, fit_on, foreign_cpu, kept_samples, kill_moments, median_step_seconds,
        planned_samples, recovery_phases, sample_errors, spaced_kill_plan, start_local_ray, survivor_pauses,
        timed_kill_schedule,
    )
    from ray_resilient.testing.image_volume import SHAPES, make_image_volume
    from ray_resilient.testing.local_cluster import LocalNode, LocalRayCluster
    from ray_resilient.testing.ports import LOOPBACK, free_port
    from ray_resilient.testing.records import RecordKind, Recorder, of_kind, read_records
    from ray_resilient.testing.s3_server import S3Server, seaweedfs
    from ray_resilient.testing.synthetic_data import CLASSES, FEATURES, SyntheticBatches
    from ray_resilient.testing.waiting import wait_until

_EXPORTS = {
    "Driver": "driver",
    "DriverError": "driver",
    "run_driver": "driver",
    "SHAPES": "image_volume",
    "make_image_volume": "image_volume",
    "LocalNode": "local_cluster",
    "LocalRayCluster": "local_cluster",
    "LOOPBACK": "ports",
    "free_port": "ports",
    "S3Server": "s3_server",
    "seaweedfs": "s3_server",
    "CLASSES": "synthetic_data",
    "FEATURES": "synthetic_data",
    "SyntheticBatches": "synthetic_data",
    "wait_until": "waiting",
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
