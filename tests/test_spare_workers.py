"""Spare worker configuration and the preload hook (the restart itself: test_chaos)."""

from __future__ import annotations

import pytest
from ray_resilient import recommended_ray_config, spare_workers
from ray_resilient._ray_internals import worker_setup_hook_env_var


def test_the_recommended_config_gives_workers_the_preload_hook_and_turns_spares_on(monkeypatch):
    monkeypatch.delenv(spare_workers.SPARE_WORKERS_ENV, raising=False)
    config = recommended_ray_config("run", "/tmp/storage", workers=2, preload=("torch", "torchvision"))
    env = config.run_config.worker_runtime_env["env_vars"]
    assert env[worker_setup_hook_env_var()] == "ray_resilient.spare_workers.preload_modules"
    assert env[spare_workers.PRELOAD_ENV] == "torch,torchvision"
    assert env[spare_workers.SPARE_WORKERS_ENV] == "1"
    assert env["OMP_NUM_THREADS"] == "1"  # as Ray sets it for a 1-CPU worker, before torch is imported
    wide = recommended_ray_config("run", "/tmp/storage", workers=2, resources_per_worker={"CPU": 4.5})
    assert wide.run_config.worker_runtime_env["env_vars"]["OMP_NUM_THREADS"] == "4"
    off = recommended_ray_config("run", "/tmp/storage", workers=2, spare_workers=False)
    assert not off.run_config.worker_runtime_env


def test_a_driver_environment_turns_spares_off_unless_the_config_asks_for_them(monkeypatch):
    monkeypatch.setenv(spare_workers.SPARE_WORKERS_ENV, "0")
    assert not recommended_ray_config("run", "/tmp/storage", workers=2).run_config.worker_runtime_env
    asked = recommended_ray_config("run", "/tmp/storage", workers=2, spare_workers=True)
    assert asked.run_config.worker_runtime_env["env_vars"][spare_workers.SPARE_WORKERS_ENV] == "1"


def test_preload_names_that_cannot_be_passed_are_refused():
    with pytest.raises(ValueError, match="without commas"):
        spare_workers.worker_env(("torch,torchvision",))


def test_a_module_that_fails_to_preload_is_logged_and_skipped(monkeypatch, caplog):
    monkeypatch.setenv(spare_workers.PRELOAD_ENV, "json,ray_resilient_no_such_module,csv")
    monkeypatch.setattr(spare_workers, "preloaded", [])
    spare_workers.preload_modules()
    assert spare_workers.preloaded == ["json", "csv"]
    assert "Could not preload ray_resilient_no_such_module" in caplog.text
