"""Every use of a private or unstable Ray API, behind one wall.

ray_resilient needs a few things Ray 2.60 offers only internally or as a DeveloperAPI: the Ray Train
run's id and storage (``get_storage()``), a worker's preemption signal without a barrier, the raylet's ``PrestartWorkers`` RPC and the worker setup
hook's variable (spare workers), the GCS's node table (the local test cluster), environment
variables read by Ray's C++ core and Train V2's controller, replica-group replacement
(``has_replica_groups``, survivor mode), the callback that starts an attempt's ``DatasetManager``,
the text of the controller's log (restart timings), the autoscaler's config schema
(``cluster/``) and the driver's echo of worker output (the console). Nothing else in the
repository (package, jobs, benchmarks, tests) touches ``ray._private``, ``ray._raylet``, any
``_internal`` or other underscore module of Ray, or those DeveloperAPIs: ``tests/test_layering.py``
scans for them.

Each use has a test in ``tests/test_ray_internals.py`` that fails loudly when a Ray upgrade moves
it. At run time a moved API degrades to a warning and a fallback where one exists, never an
ImportError: spare workers are skipped, the run id falls back to the driver's job id. Code
outside the package reaches this module only through public names: the experiment kit's
(``ray_resilient.testing``: ``start_local_ray``, ``recovery_phases``) and
:meth:`ray_resilient.storage.RunStorage.from_ray_context`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    import pyarrow.fs as pafs

logger = logging.getLogger(__name__)

# Train V2 controller settings (ray.train.v2._internal.constants).
TRAIN_HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
TRAIN_WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
TRAIN_PRINT_PATCH_ENV = "RAY_TRAIN_ENABLE_PRINT_PATCH"
TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_ENV = "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"

# The GCS's health checks of the raylets (Ray's C++ config; defaults: every 3 s, dead after 5
# misses, about 15 s). These make a lost node dead after about 3 s (set on the head node).
FAST_NODE_FAILURE_DETECTION = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}

# The state API server Ray's tools ask (ray._private.ray_constants). A cluster without a dashboard
# has none, so Ray Train's PlacementGroupCleaner would ask whatever dashboard listens on the
# default 127.0.0.1:8265 (another local cluster's), not find the run's controller there, and
# remove the run's placement group. A driver of such a cluster points it nowhere instead.
API_SERVER_ADDRESS_ENV = "RAY_API_SERVER_ADDRESS"
NO_API_SERVER = {API_SERVER_ADDRESS_ENV: "http://127.0.0.1:1"}

_ALIVE = 0  # GcsNodeInfo.GcsNodeState.ALIVE
_BackendType = TypeVar("_BackendType", bound=type)


def train_run_id() -> str:
    """The current Ray Train run's id (one per ``fit()``: restarted worker groups share it).

    Fallback when Ray moved it: the driver's job id, which restarts of one ``fit()`` share too.
    """
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().train_run_context.run_id
    except (ImportError, AttributeError) as err:
        import ray

        logger.warning("Ray Train's run id is not where ray_resilient expects it (%r); using the job id", err)
        return f"job-{ray.get_runtime_context().get_job_id()}"


def local_preemption_info() -> Any | None:
    """This worker's latest preemption signal for its worker group: what ``ray.train.get_preemption_info()``
    broadcasts from rank 0, read without that barrier across every worker (for survivor mode's lead,
    which asks alone). None when there is none, or, with a warning, when Ray moved it."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except (ImportError, AttributeError) as err:
        logger.warning("Ray Train's preemption signal is not where ray_resilient expects it (%r): "
                       "no preemption save", err)
        return None


def train_run_storage() -> tuple[pafs.FileSystem, str]:
    """The current Ray Train run's storage filesystem and run directory on it (call inside a train
    function). ``TrainContext.get_storage()`` is a DeveloperAPI: its ``StorageContext`` may change
    between minor versions, and it has no fallback."""
    import ray.train

    storage = ray.train.get_context().get_storage()
    return storage.storage_filesystem, storage.experiment_fs_path


def worker_setup_hook_env_var() -> str | None:
    """The variable that names Ray's worker process setup hook, or None (with a warning) when it moved."""
    try:
        from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    except ImportError as err:
        logger.warning("Ray's worker setup hook variable moved (%r): spare workers will not preload modules", err)
        return None
    return WORKER_PROCESS_SETUP_HOOK_ENV_VAR


def prestart_workers(count: int, keep_alive_s: int) -> bool:
    """Ask this node's raylet for ``count`` idle workers of this job with this worker's runtime env.

    Call from inside a Ray worker. Returns whether the raylet accepted; logs a warning otherwise.
    """
    try:
        import ray
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

        context = ray.get_runtime_context()
        node = next(n for n in ray.nodes() if n["NodeID"] == context.get_node_id())
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.Language.PYTHON,
            job_id=ray.JobID.from_hex(context.get_job_id()).binary(),
            keep_alive_duration_secs=keep_alive_s,
            num_workers=count,
        )
        request.runtime_env_info.serialized_runtime_env = context.get_runtime_env_string()
        channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
        try:
            node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
        finally:
            channel.close()
    except Exception:  # noqa: BLE001 - spares only speed up the next restart
        logger.warning("Could not start spare Ray workers; the next restart starts new processes", exc_info=True)
        return False
    return True


def alive_node_ids(gcs_address: str) -> list[str]:
    """The ids (hex) of the nodes the GCS at ``gcs_address`` counts alive; empty while it does not answer."""
    from ray._raylet import GcsClient

    try:
        nodes = GcsClient(address=gcs_address).get_all_node_info(timeout=5)
    except Exception:  # noqa: BLE001 - the GCS is still starting, or gone
        return []
    return [info.node_id.hex() for info in nodes.values() if info.state == _ALIVE]


# Ray Train's controller log: the record of its decision to restart, and the records that end
# the phases of the new worker group's start.
_CONTROLLER_RETRY = "[FailurePolicy] RETRY"
_CONTROLLER_RESTART_MARKS = {
    "stop+pg": "[Worker Group Initialization] Placement group ready",
    "actors": "worker actors created",
    "context": "[Worker Group Initialization] Train context initialized",
}


@dataclass(frozen=True)
class ControllerRestart:
    """A restart of the worker group as Ray Train's controller logged it (times in s since the epoch).

    ``retry``: when it decided to restart (NaN: no decision logged). ``phases``: when each phase
    of the new group's start ended, in :attr:`PHASES` order: ``stop+pg`` (the old group stopped,
    the new placement group ready), ``actors`` (the workers' actors created), ``context`` (Ray
    Train's context set up on them); NaN for a phase not logged.
    """

    PHASES: ClassVar[tuple[str, ...]] = tuple(_CONTROLLER_RESTART_MARKS)
    retry: float
    phases: dict[str, float] = field(default_factory=dict)


def controller_restart(ray_temp_dir: Path, after: float, before: float) -> ControllerRestart:
    """The first restart the controller of the Ray cluster in ``ray_temp_dir`` decided on between
    ``after`` and ``before`` (e.g. a kill and the restarted train function's start), each phase
    ended by its last record before ``before`` (a group start that is retried logs its phases again)."""
    records = _controller_log(ray_temp_dir)
    retry = next((t for t, message in records if after < t < before and message.startswith(_CONTROLLER_RETRY)),
                 math.nan)
    phases = {name: max((t for t, message in records if retry < t < before and needle in message), default=math.nan)
              for name, needle in _CONTROLLER_RESTART_MARKS.items()}
    return ControllerRestart(retry, phases)


def _controller_log(ray_temp_dir: Path) -> list[tuple[float, str]]:
    """(time in s since the epoch, message) of Ray Train's controller log records, oldest first.

    The ``sys`` log (``ray-train-sys-controller-*.log``) has every record, DEBUG included (the
    worker-group start-up timings); the ``app`` log, at the run's log level, is the fallback.
    """
    for kind in ("sys", "app"):
        pattern = str(Path(ray_temp_dir) / "**" / f"ray-train-{kind}-controller-*.log")
        records = []
        for path in glob.glob(pattern, recursive=True):
            for line in Path(path).read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                    records.append((int(record["timestamp_ns"]) / 1e9, str(record["message"])))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue
        if records:
            return sorted(records)
    return []


def is_replica_group(worker_group: object) -> bool:
    """Whether a backend's ``on_start`` was handed one replacement replica group (Ray Train 2.60's
    ``ReplicaGroup``), not a whole worker group starting."""
    try:
        from ray.train.v2._internal.execution.worker_group import ReplicaGroup
    except ImportError as err:
        logger.warning("Ray Train's ReplicaGroup is not where ray_resilient expects it (%r)", err)
        return type(worker_group).__name__ == "ReplicaGroup"
    return isinstance(worker_group, ReplicaGroup)


def without_unused_dataset_manager(trainer: Any) -> Any:
    """``trainer`` (a Ray Train 2.60 ``DataParallelTrainer``), made not to start a ``DatasetManager``
    actor when it has no ``datasets``: Ray starts one for every attempt of every run, a new process
    importing Ray Data and pandas (about 2 CPU s) that nothing asks anything of. Warns and leaves the
    trainer as it is when this Ray moved the callback that starts it."""
    if getattr(trainer, "datasets", None) or not hasattr(trainer, "_create_default_callbacks"):
        return trainer
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError as err:
        logger.warning("Ray Train's DatasetsCallback is not where ray_resilient expects it (%r)", err)
        return trainer
    default_callbacks = trainer._create_default_callbacks
    trainer._create_default_callbacks = lambda: [
        callback for callback in default_callbacks() if not isinstance(callback, DatasetsCallback)]
    return trainer


def with_replica_groups(backend_cls: _BackendType) -> _BackendType:
    """``backend_cls`` (a Ray Train ``Backend``) marked ``has_replica_groups``, a DeveloperAPI of Ray
    Train 2.60 built for torchft: its controller then replaces only a failed worker's replica group,
    leaving the others running. Warns when this Ray's ``Backend`` no longer has the flag."""
    from ray.train.backend import Backend

    if not hasattr(Backend, "has_replica_groups"):
        logger.warning("Ray Train's Backend has no has_replica_groups: a failure will restart every worker")
    backend_cls.has_replica_groups = True
    return backend_cls


def validate_cluster_config(config: dict[str, Any]) -> None:
    """Check a ``ray up`` cluster config as ``ray up`` does: Ray's schema, after filling in the
    defaults (raises jsonschema's ``ValidationError``)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(config))


WORKER_OUTPUT_HANDLER = "ray_print_logs"  # the name Ray's driver gives its printer of worker output


@contextlib.contextmanager
def worker_output_filtered(shown: Callable[[dict[str, Any]], list[str]]) -> Iterator[None]:
    """Within, the driver echoes of each batch of worker output only the lines ``shown`` returns
    (a batch: ``pid`` (``"raylet"`` for the error messages the raylet sends), ``actor_name``,
    ``lines``, ...); Ray's printer and its deduplication are otherwise unchanged, and its log files
    keep every line. Without Ray's printer (``log_to_driver=False``, or one that moved), the worker
    output is left as it is."""
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printers = [handler for name, handler in dispatcher.handlers if name == WORKER_OUTPUT_HANDLER]
    print_errors = ray_worker.print_to_stdstream  # the raylet's error messages go straight to it

    def only_shown(printer: Callable[..., None]) -> Callable[..., None]:
        def print_shown(data: dict[str, Any], **kwargs: Any) -> None:
            lines = shown(data)
            if lines:
                printer({**data, "lines": lines}, **kwargs)
        return print_shown

    if len(printers) == 1:
        dispatcher.remove_handler(WORKER_OUTPUT_HANDLER)
        dispatcher.add_handler(WORKER_OUTPUT_HANDLER, only_shown(printers[0]))
    ray_worker.print_to_stdstream = only_shown(print_errors)
    try:
        yield
    finally:
        ray_worker.print_to_stdstream = print_errors
        if len(printers) == 1:
            dispatcher.remove_handler(WORKER_OUTPUT_HANDLER)
            dispatcher.add_handler(WORKER_OUTPUT_HANDLER, printers[0])
