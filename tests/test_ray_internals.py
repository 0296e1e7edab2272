"""One test per private or unstable Ray API in ``ray_resilient._ray_internals``: each fails loudly
when a Ray upgrade moves what the wall relies on (at run time the wall only warns)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import time
from pathlib import Path

import pytest
import ray

from ray_resilient import _ray_internals


def test_train_v2_reads_the_controller_settings_we_set():
    from ray.train.v2._internal import constants

    assert constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR == _ray_internals.TRAIN_HEALTH_CHECK_INTERVAL_ENV
    assert constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR == _ray_internals.TRAIN_WORKER_GROUP_START_TIMEOUT_ENV
    assert constants.ENABLE_PRINT_PATCH_ENV_VAR == _ray_internals.TRAIN_PRINT_PATCH_ENV
    assert constants.WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR == _ray_internals.TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_ENV
    for name in (constants.ENABLE_PRINT_PATCH_ENV_VAR, constants.WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR):
        assert name in constants.ENV_VARS_TO_PROPAGATE  # driver -> controller and workers


def test_the_gcs_knows_the_health_check_settings_we_set():
    """Ray's C++ config reads ``RAY_<name>``: the GCS server binary must still know each name."""
    gcs_server = Path(ray.__file__).parent / "core" / "src" / "ray" / "gcs" / "gcs_server"
    binary = gcs_server.read_bytes()
    for variable in _ray_internals.FAST_NODE_FAILURE_DETECTION:
        assert variable.removeprefix("RAY_").encode() in binary, variable


def test_ray_reads_the_api_server_address_variable():
    from ray._private import ray_constants

    assert ray_constants.RAY_API_SERVER_ADDRESS_ENVIRONMENT_VARIABLE == _ray_internals.API_SERVER_ADDRESS_ENV


def test_the_train_run_id_is_where_the_wall_reads_it():
    from ray.train.v2._internal.execution.context import TrainContext, TrainRunContext, get_train_context

    assert callable(get_train_context)
    assert "train_run_context" in {f.name for f in dataclasses.fields(TrainContext)}
    assert "run_id" in {f.name for f in dataclasses.fields(TrainRunContext)}


def test_a_workers_preemption_signal_is_where_the_wall_reads_it():
    from ray.train.v2._internal.execution.context import TrainContext
    from ray.train.v2._internal.execution.preemption import PreemptionContext
    from ray.train.v2._internal.execution.train_fn_utils import DistributedTrainFnUtils

    assert "preemption_context" in {f.name for f in dataclasses.fields(TrainContext)}
    assert "preemption_info" in {f.name for f in dataclasses.fields(PreemptionContext)}
    # Ray's own get_preemption_info() broadcasts that very field from rank 0.
    assert "preemption_context.preemption_info" in inspect.getsource(DistributedTrainFnUtils.get_preemption_info)


def test_the_train_context_gives_the_runs_storage_where_the_wall_reads_it(tmp_path):
    """``get_storage()`` is a DeveloperAPI; its ``StorageContext`` has the run's filesystem and directory."""
    import pyarrow.fs as pafs
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2.api.context import TrainContext

    assert callable(TrainContext.get_storage)
    storage = StorageContext(str(tmp_path), "run")
    assert isinstance(storage.storage_filesystem, pafs.FileSystem)
    assert storage.experiment_fs_path == f"{tmp_path}/run"


def test_a_replacement_replica_group_is_told_from_a_whole_worker_group():
    """Survivor mode's backend starts a coordinator per worker group and only joins a replacement
    replica group to it; the controller replaces only failed replica groups for a backend with
    ``has_replica_groups`` (what ``tests/test_survivors.py`` runs on)."""
    import inspect

    from ray.train.backend import Backend
    from ray.train.v2._internal.execution.controller import controller
    from ray.train.v2._internal.execution.worker_group import ReplicaGroup, WorkerGroup

    assert _ray_internals.is_replica_group(object.__new__(ReplicaGroup))
    assert not _ray_internals.is_replica_group(object.__new__(WorkerGroup))
    assert Backend.has_replica_groups is False
    assert "has_replica_groups" in inspect.getsource(controller)
    assert _ray_internals.with_replica_groups(type("Replicated", (Backend,), {})).has_replica_groups is True


def test_ray_ups_schema_check_takes_a_config_and_refuses_a_bad_one():
    import jsonschema

    config = {"cluster_name": "x", "provider": {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}}
    _ray_internals.validate_cluster_config(config)
    with pytest.raises(jsonschema.ValidationError):
        _ray_internals.validate_cluster_config({**config, "idle_timeout_minutes": "soon"})


def test_the_worker_setup_hook_variable_exists():
    assert _ray_internals.worker_setup_hook_env_var() is not None


def test_the_gcs_client_lists_this_clusters_node_alive(ray_cluster):
    context = ray.get_runtime_context()
    assert _ray_internals.alive_node_ids(context.gcs_address) == [context.get_node_id()]


def test_the_raylet_accepts_a_prestart_request(ray_cluster):
    @ray.remote(num_cpus=0)
    def prestart() -> bool:
        return _ray_internals.prestart_workers(1, keep_alive_s=5)

    assert ray.get(prestart.remote())


@pytest.mark.slow
def test_a_train_run_has_its_run_id_and_storage_and_the_controller_logs_its_restart(ray_cluster, tmp_path):
    """Inside a real train function the run id and storage come from Ray (not the job-id
    fallback), and the controller's log has the records a restart is timed by
    (``controller_restart``, behind the experiment kit's ``recovery_phases``): the retry decision
    (the first attempt fails) and the phases of the restarted worker group's start. Neither attempt
    started a DatasetManager actor (``without_unused_dataset_manager``: the run has no datasets)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path / "run_id.json"

    def train_fn() -> None:
        first_attempt = not out.exists()
        out.write_text(json.dumps([_ray_internals.train_run_id(), _ray_internals.train_run_storage()[1]]))
        if first_attempt:
            raise RuntimeError("the first attempt fails, so that the controller retries")

    run_config = RunConfig(name="internals", storage_path=str(tmp_path / "storage"),
                           failure_config=FailureConfig(max_failures=1))
    def dataset_managers() -> int:
        return sum(actor["ActorClassName"] == "DatasetManager" for actor in ray._private.state.actors().values())

    managers_before, started = dataset_managers(), time.time()
    trainer = TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=1), run_config=run_config)
    assert _ray_internals.without_unused_dataset_manager(trainer).fit().error is None
    assert dataset_managers() == managers_before
    run_id, run_dir = json.loads(out.read_text())
    assert re.fullmatch(r"[0-9a-f]{32}", run_id) and run_dir == f"{tmp_path}/storage/internals"
    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    restart = _ray_internals.controller_restart(session_dir, after=started, before=time.time())
    assert not math.isnan(restart.retry)
    assert list(restart.phases) == list(restart.PHASES)
    assert all(restart.retry < t for t in restart.phases.values()), restart.phases  # NaN (not logged) fails


def test_the_drivers_echo_of_worker_output_shows_only_the_chosen_lines_within(ray_cluster, capfd):
    """Within, an actor's lines and the raylet's error messages reach the driver's console only as
    the filter chooses; after it, as Ray prints them."""
    from ray_resilient.testing import wait_until

    @ray.remote(num_cpus=0)
    class Talker:
        def say(self, *lines: str) -> None:
            for line in lines:
                print(line, flush=True)

    talker = Talker.remote()
    batches: list[dict] = []
    printed: list[str] = []

    def shown(batch: dict) -> list[str]:
        batches.append(batch)
        return [line for line in batch["lines"] if "shown" in line]

    def console_has(text: str) -> bool:
        printed.append(capfd.readouterr().out)
        return text in "".join(printed)

    with _ray_internals.worker_output_filtered(shown):
        ray.get(talker.say.remote("line shown", "line hidden"))
        wait_until(lambda: console_has("line shown"), timeout=30, what="the actor's shown line on the console")
        ray._private.worker.print_to_stdstream({"lines": ["raylet hidden"], "pid": "raylet", "is_err": False},
                                               ignore_prefix=False)
    ray.get(talker.say.remote("line after"))
    wait_until(lambda: console_has("line after"), timeout=30, what="the actor's line after the filter")
    console = "".join(printed)
    assert "line hidden" not in console and "raylet hidden" not in console
    assert any(b.get("actor_name") == "Talker" for b in batches) and any(b["pid"] == "raylet" for b in batches)
