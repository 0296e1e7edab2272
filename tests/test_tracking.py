"""The MLflow tracking store: a new local store opened by several processes at once stays usable."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time

import pytest

from ray_resilient.tracking import _store_lock, open_tracking_client


def _open_and_log(uri: str, start, results) -> None:
    start.wait()
    try:
        client = open_tracking_client(uri)
        client.create_experiment(f"from-{multiprocessing.current_process().name}")
        results.put("ok")
    except Exception as err:  # reported to the test, which names it
        results.put(f"{type(err).__name__}: {err}")


@pytest.mark.parametrize("trial", range(2))
def test_processes_that_open_a_new_sqlite_store_at_once_all_get_a_working_store(tmp_path, trial):
    """MLflow migrates a new SQLite store in whichever process opens it first; unserialized, four
    processes opening it at the same moment fail (table already exists, a migration that matched no
    row) and can leave it half-migrated for every later user (the CI failure of 2026-12-01)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spawn = multiprocessing.get_context("spawn")
    start, results = spawn.Barrier(4), spawn.Queue()
    processes = [spawn.Process(target=_open_and_log, args=(uri, start, results), name=f"p{i}") for i in range(4)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=300) for _ in processes]
    for process in processes:
        process.join()
    assert outcomes == ["ok"] * 4
    from mlflow.tracking import MlflowClient

    names = {e.name for e in MlflowClient(uri).search_experiments()}
    assert {f"from-p{i}" for i in range(4)} <= names


def test_a_process_forked_while_the_store_is_opened_does_not_keep_it_locked(tmp_path):
    """A data loader forks its workers while a background metrics thread opens the store. Under an
    flock the forked worker shared the lock and held it while it lived: a persistent worker, all
    the run, so the job's next open (adding its model to the MLflow run, at the end) waited for
    ever (the README test's uninterrupted job, 2026-12-03)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with _store_lock(str(tmp_path / "mlflow.db")):
        worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
        worker.start()  # lives on, as a persistent loader worker does
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as opening:
            opening.submit(open_tracking_client, uri).result(timeout=60)
    finally:
        worker.kill()
