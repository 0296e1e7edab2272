"""The MLflow tracking store: a new local store opened by several processes at once stays usable."""

from __future__ import annotations

import multiprocessing

import pytest

from ray_resilient.tracking import open_tracking_client


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
