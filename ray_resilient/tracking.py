"""MLflow metrics for a Ray Train run: one MLflow run per Ray Train run, found again after restarts.

Telemetry never stops training: the metrics the library logs by default (``data/...`` from the
loader, ``goodput/...`` from the checkpointer) go through :class:`BackgroundMetrics`, so an
MLflow outage (its client retries for minutes, then raises) neither blocks nor raises in the loop.

The names in ``__all__`` are public, for a train function's own metrics and files: e.g.
``BackgroundMetrics(lambda: MlflowMetrics(current_run_name()), "job")`` on rank 0.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

__all__ = ["BackgroundMetrics", "MetricsLogger", "MlflowMetrics", "current_run_name", "default_tracking_uri",
           "log_artifact", "open_tracking_client"]

logger = logging.getLogger(__name__)

RUN_TAG = "ray_resilient.run"
_FIND_OR_CREATE: dict[tuple[str, str, str], threading.Lock] = {}
_FIND_OR_CREATE_GUARD = threading.Lock()


def _find_or_create_lock(tracking_uri: str, experiment: str, run_name: str) -> threading.Lock:
    """One lock per MLflow run and process (a store that is down holds up only its own loggers)."""
    with _FIND_OR_CREATE_GUARD:
        return _FIND_OR_CREATE.setdefault((tracking_uri, experiment, run_name), threading.Lock())
MetricsLogger = Callable[[dict[str, float], int], None]


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a local SQLite store in ``~/.ray_resilient``."""
    configured = os.environ.get("MLFLOW_TRACKING_URI")
    if configured:
        return configured
    directory = os.path.expanduser("~/.ray_resilient")
    os.makedirs(directory, exist_ok=True)
    return f"sqlite:///{directory}/mlflow.db"


def _sqlite_file(uri: str) -> str | None:
    """The database file of a ``sqlite:///PATH`` URI, None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    return uri[len("sqlite:///"):].split("?", 1)[0] or None


def open_tracking_client(uri: str | None = None) -> MlflowClient:
    """An ``MlflowClient`` on ``uri`` (default :func:`default_tracking_uri`), its store ready.

    MLflow creates a new SQLite store by running its schema migrations in the first process that
    opens it; two processes (or threads) that do so at once can leave the store half-migrated, and
    unusable, for good. A local SQLite store is therefore opened under :func:`_store_lock`.
    """
    from mlflow.tracking import MlflowClient

    uri = uri or default_tracking_uri()
    database = _sqlite_file(uri)
    if database is None:
        return MlflowClient(uri)
    os.makedirs(os.path.dirname(os.path.abspath(database)), exist_ok=True)
    with _store_lock(database):
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # opens the store: creates and migrates it if new
        return client


_STORE_OPEN_GUARD = threading.Lock()  # the threads of one process, which a record lock does not tell apart


@contextlib.contextmanager
def _store_lock(database: str) -> Iterator[None]:
    """An exclusive lock on ``<database>.lock`` against every other thread and process. A POSIX
    record lock: a process forked while it is held (a data loader's worker) does not inherit it,
    as it would an ``flock`` (kept until the child exits: every later open in the parent waited)."""
    with _STORE_OPEN_GUARD, open(f"{database}.lock", "a") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        yield


def current_run_name() -> str:
    """The Ray Train run's name inside a train function, else ``"ray_resilient"``."""
    try:
        import ray.train

        return ray.train.get_context().get_experiment_name()
    except (RuntimeError, ValueError):
        return "ray_resilient"


class MlflowMetrics:
    """Logs metric dicts to the MLflow run of ``run_name`` (created on first use, reused after).

    Every attempt of a Ray Train run (restarts, a re-run driver) finds the same MLflow run by
    its tag, so a run's curves continue across failures.
    """

    def __init__(self, run_name: str, tracking_uri: str | None = None, experiment: str = "ray_resilient",
                 prefix: str = ""):
        uri = tracking_uri or default_tracking_uri()
        self.client = open_tracking_client(uri)
        self.prefix = prefix
        # The loggers of one process (the job's, the loader's, the goodput recorder's) start on
        # their own threads, possibly at once: one of them finds or creates the run at a time.
        with _find_or_create_lock(uri, experiment, run_name):
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            runs = self.client.search_runs([experiment_id], f"tags.`{RUN_TAG}` = '{run_name}'", max_results=1)
            if runs:
                self.run_id = runs[0].info.run_id
            else:
                self.run_id = self.client.create_run(experiment_id, tags={RUN_TAG: run_name},
                                                     run_name=run_name).info.run_id

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(f"{self.prefix}{key}", float(value), now, step) for key, value in metrics.items()])


def log_artifact(run_name: str, local_path: str, tracking_uri: str | None = None) -> bool:
    """Add a file to the MLflow run of ``run_name``; False, with a warning, if the store fails
    (the file is already kept elsewhere: telemetry never fails a run)."""
    try:
        mlflow = MlflowMetrics(run_name, tracking_uri)
        mlflow.client.log_artifact(mlflow.run_id, local_path)
    except Exception as err:
        logger.warning("could not add %s to the MLflow run %r (%s: %s)", os.path.basename(local_path), run_name,
                       type(err).__name__, err)
        return False
    return True


class BackgroundMetrics:
    """A metrics logger that never blocks or raises in the caller.

    Calls are queued (at most ``max_queued``) and a daemon thread delivers them to the logger that
    ``make_logger`` builds there as it starts (opening a tracking store hangs as long as the store
    is down). A full queue drops the call (counted in ``dropped``), a failing delivery is counted
    in ``failed``; each is warned about once.
    """

    def __init__(self, make_logger: Callable[[], MetricsLogger], name: str, max_queued: int = 100):
        self.name = name
        self.logger: MetricsLogger | None = None
        self.delivered = self.dropped = self.failed = 0
        self._make_logger = make_logger
        self._queue: queue.Queue = queue.Queue(max_queued)
        threading.Thread(target=self._deliver, daemon=True, name=f"ray_resilient_{name}_metrics").start()

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        try:
            self._queue.put_nowait((dict(metrics), step))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("%s metrics are not being delivered fast enough (is the tracking server reachable?): "
                               "dropping them rather than slowing training (counted in dropped)", self.name)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued call was delivered or failed; False if ``timeout`` passed first."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)

    def _deliver(self) -> None:
        # Opened before the first call: importing MLflow and opening its store take seconds, which
        # the first or the final figures (flushed at the end of an attempt) would otherwise wait for.
        # A failure here is retried, and reported, at the first delivery.
        with contextlib.suppress(Exception):
            self.logger = self._make_logger()
        while True:
            metrics, step = self._queue.get()
            try:
                if self.logger is None:
                    self.logger = self._make_logger()
                self.logger(metrics, step)
                self.delivered += 1
            except Exception as err:  # telemetry must not stop training: count, warn once, go on
                self.failed += 1
                if self.failed == 1:
                    logger.warning("logging %s metrics failed (%s: %s); training goes on, later failures are "
                                   "counted in failed", self.name, type(err).__name__, err)
            finally:
                self._queue.task_done()


def check_metrics_logger(setting: MetricsLogger | str | None, knob: str = "a metrics logger") -> None:
    """``ValueError`` naming ``knob`` unless ``setting`` is ``"mlflow"``, a callable or None."""
    if isinstance(setting, str) and setting != "mlflow" or not (setting is None or isinstance(setting, str)
                                                                or callable(setting)):
        raise ValueError(f"{knob} is 'mlflow', a callable (metrics, step) or None; got {setting!r}")


def resolve_metrics_logger(setting: MetricsLogger | str | None, *, prefix: str, name: str,
                           enabled: bool = True) -> MetricsLogger | None:
    """The logger a ``metrics_logger`` / ``goodput_logger`` setting names, checked at construction.

    ``"mlflow"``: the MLflow run of the current Ray Train run (metrics ``<prefix>...``), through a
    :class:`BackgroundMetrics` (opened on its delivery thread as it starts); a callable
    ``(metrics, step)`` as is; None logs nothing. ``enabled=False`` (ranks other than 0) checks
    the setting and returns None.
    """
    check_metrics_logger(setting)
    if not enabled or setting is None:
        return None
    if setting == "mlflow":
        run_name = current_run_name()
        return BackgroundMetrics(lambda: MlflowMetrics(run_name, prefix=prefix), name)
    return setting
