"""Shared fixtures: a real local Ray cluster, and helpers to run the test training job."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ray_resilient._ray_internals import NO_API_SERVER

TESTS_DIR = Path(__file__).parent
# Ray workers are separate processes: they find tests/trainlib.py through PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])
)
# The controller polls worker health every 2 s by default; recover faster in tests.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# Ray Train starts a preemption watcher (an actor: a process, 2 CPU seconds) for every worker group
# it starts, to poll node drains. Only the test of preemption drains a node; it turns the watcher
# back on for its cluster (PREEMPTION_WATCHER_ON).
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
PREEMPTION_WATCHER_ON = {PREEMPTION_WATCHER: "1"}
os.environ.setdefault(PREEMPTION_WATCHER, "0")
# The in-process clusters of these tests have no dashboard (see NO_API_SERVER).
os.environ.update(NO_API_SERVER)
sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(autouse=True, scope="session")
def mlflow_store(tmp_path_factory):
    """A real, local MLflow tracking store for the session (never the user's own), created here
    before any test's processes open it. None where MLflow is not installed (the GPU image of
    scripts/gpu_check.sh, whose tests track nothing)."""
    import importlib.util

    from ray_resilient.tracking import open_tracking_client

    if importlib.util.find_spec("mlflow") is None:
        return None

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    open_tracking_client(uri)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    return uri


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """A fresh local Ray cluster for the session (never attaches to a leftover one): its address.

    Driver processes a test starts (a job, the notebook's kernel) attach to it by this address
    instead of starting a Ray instance each (15-20 s apiece on 2 cores); only the test of the
    README's own command starts its own, as a user's first run does.
    """
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def driver_env(ray_cluster) -> dict[str, str]:
    """The environment of a driver process that attaches to the session's cluster."""
    return {**os.environ, "RAY_ADDRESS": ray_cluster}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS serving S3 on a free loopback port for the session, with one bucket."""
    from ray_resilient.testing import seaweedfs

    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def multi_node_cluster(tmp_path_factory):
    """A CPU-less head (all training lands on worker nodes) plus one 2-CPU worker node, with Ray
    Train's preemption watcher on (the test of preemption's cluster)."""
    from ray_resilient.testing import LocalRayCluster

    with LocalRayCluster(tmp_path_factory.mktemp("ray"), env={**os.environ, **PREEMPTION_WATCHER_ON}) as cluster:
        cluster.add_node(cpus=2)
        yield cluster


def _reference_run(tmp_path_factory, parallelism: str) -> dict:
    import trainlib

    root = tmp_path_factory.mktemp(f"reference-{parallelism}")
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(root / "rec", parallelism=parallelism),
                              str(root / "storage"), "reference")
    assert result.error is None
    return {"dir": root, "result": result, "record": root / "rec"}


@pytest.fixture(scope="session")
def reference(ray_cluster, tmp_path_factory):
    """An uninterrupted run of ``trainlib.train_fn`` (DDP): what every resumed run must match bitwise."""
    return _reference_run(tmp_path_factory, "ddp")


@pytest.fixture(scope="session")
def fsdp_reference(ray_cluster, tmp_path_factory):
    """The same uninterrupted run with FSDP2 (its reductions differ from DDP's: its own reference)."""
    return _reference_run(tmp_path_factory, "fsdp")


@pytest.fixture(scope="session")
def image_dir(tmp_path_factory) -> str:
    """A local ImageFolder volume of 69 real JPEGs (3 classes x 23, 20x20 pixels)."""
    import pyarrow.fs as pafs

    from ray_resilient.testing import make_image_volume

    root = tmp_path_factory.mktemp("volume") / "shapes"
    make_image_volume(pafs.LocalFileSystem(), str(root), classes=3, per_class=23, size=20, seed=5)
    return str(root)
