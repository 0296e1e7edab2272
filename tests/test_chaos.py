"""Chaos tests: real SIGKILLs of workers, nodes and drivers; the run must be the same run afterwards.

The uninterrupted ``reference`` run (conftest) is what every recovered run must match: bitwise
final weights and, step by step, the global batches it trained on.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed.checkpoint as dcp

import trainlib
from ray_resilient.goodput import read_events
from ray_resilient.goodput.accounting import PARTS
from ray_resilient import RunFailedError, list_checkpoints, random_kill_plan, recommended_ray_config
from ray_resilient.testing import Driver, DriverError, LocalRayCluster, SyntheticBatches, wait_until

pytestmark = pytest.mark.slow

STEPS = trainlib.JOB["samples"] // trainlib.JOB["global_batch"] * trainlib.JOB["epochs"]


def planned_global_batches(samples: int, global_batch: int, seed: int, epochs: int) -> list[list[int]]:
    """The global batches of the plan, in order: what one rank of a world of one would read."""
    data = SyntheticBatches(samples, global_batch, seed, rank=0, world_size=1)
    return [ids.tolist() for _ in range(epochs) for ids, _, _ in data]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_three_seeded_kills_one_during_an_upload_leave_the_run_bitwise_identical(parallelism, request, tmp_path):
    reference = request.getfixturevalue("reference" if parallelism == "ddp" else "fsdp_reference")
    plan = random_kill_plan(seed=4, kills=3, steps=STEPS, interval=trainlib.JOB["interval"], world_size=2)
    assert plan.count("kill:") == 3 and plan.count("upload=") == 1
    record = tmp_path / "rec"
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(record, plan, parallelism=parallelism),
                              str(tmp_path / "storage"), "chaos", max_failures=3)
    assert result.error is None
    assert len(trainlib.read_attempts(str(record))) == 4  # every kill restarted the run once
    # The checkpoint whose write was killed was skipped on restore and collected: none is left partial.
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "storage" / "chaos"))
    assert checkpoints and all(c.complete for c in checkpoints), checkpoints
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))
    kept = trainlib.kept_global_batches(str(record))
    assert kept == trainlib.kept_global_batches(str(reference["record"]))
    expected = planned_global_batches(trainlib.JOB["samples"], trainlib.JOB["global_batch"], trainlib.JOB["seed"],
                                      trainlib.JOB["epochs"])
    assert [kept[step] for step in sorted(kept)] == expected


PRELOAD = ("torch", "ray.train.torch", "ray_resilient", "trainlib")


@pytest.fixture(scope="module")
def killed_at_step_8(ray_cluster, tmp_path_factory) -> dict[str, Any]:
    """One run with the recommended Ray config (spare workers preloading ``PRELOAD``) whose rank 1
    is SIGKILLed after step 8 (0.1 s steps, live goodput every 5): what the restart ran on, and
    what the goodput ledger made of it."""
    from ray.train.torch import TorchTrainer

    root = tmp_path_factory.mktemp("killed-at-step-8")
    config = recommended_ray_config("killed-at-8", str(root / "storage"), workers=2, max_failures=1, preload=PRELOAD)
    loop = trainlib.job_config(root / "rec", "kill:step=8:rank=1", step_seconds=0.1, goodput_logger="mlflow",
                                goodput_log_every=5)
    driver_started = time.time()
    result = config.fit(TorchTrainer(trainlib.train_fn, train_loop_config=loop, **config.trainer_kwargs()))
    return {"record": root / "rec", "run_dir": root / "storage" / "killed-at-8", "result": result,
            "driver_started": driver_started, "fit_returned": time.time()}


def test_a_restarted_worker_group_starts_on_spare_processes_warmed_before_the_failure(reference, killed_at_step_8):
    record = killed_at_step_8["record"]
    assert killed_at_step_8["result"].error is None
    # A death is no hang: rank 0, left waiting for the killed rank 1, is not declared.
    events = read_events(pafs.LocalFileSystem(), str(killed_at_step_8["run_dir"]))
    assert not [e for e in events if e["kind"] == "hang"]
    first, second = zip(*(trainlib.read_attempts(str(record), rank) for rank in (0, 1)))
    killed = [json.loads(line) for line in open(record / f"samples-rank1-{first[1]['attempt']}.jsonl")]
    assert killed[-1]["step"] == 8
    for before, after in zip(first, second):
        assert after["pid"] != before["pid"]
        # The restarted group's processes existed before the kill, had imported what preload names...
        assert after["process_started"] < killed[-1]["time"], (after, killed[-1]["time"])
        assert after["preloaded"] == list(PRELOAD)
        # ...and were started once the first attempt trained, not with the cluster.
        assert after["process_started"] > before["process_started"]
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))


def fit_in_driver(config: dict[str, Any]) -> dict[str, str]:
    """Runs in the driver process (:func:`_driver`): ``train_fn`` with the recommended Ray configuration."""
    import ray
    from ray.train.torch import TorchTrainer

    ray.init(address=config["address"])
    workers = tuple(config["workers"]) if isinstance(config["workers"], list) else config["workers"]  # JSON
    ray_config = recommended_ray_config(config["name"], config["storage"], workers=workers, max_failures=3,
                                        resize_check_s=2, spare_workers=config["spare_workers"], preload=PRELOAD)
    result = TorchTrainer(trainlib.train_fn, train_loop_config=config["loop"], **ray_config.trainer_kwargs()).fit()
    assert result.error is None, result.error
    return {"checkpoint": result.checkpoint.path}


def _driver(address: str, env: dict[str, str], storage, name: str, workers, loop: dict, workdir, log: str,
            spare_workers: bool = True) -> Driver:
    """A driver process of the cluster at ``address`` running :func:`fit_in_driver`; its output in
    ``workdir/<log>.log``. ``spare_workers=False`` for a run no restart follows (its spares would
    only take CPU from the others)."""
    config = {"address": address, "name": name, "storage": str(storage), "workers": workers, "loop": loop,
              "spare_workers": spare_workers}
    return Driver.start("test_chaos:fit_in_driver", config, env=env, workdir=workdir, name=log)


def _steps_recorded(record, rank: int) -> int:
    files = [f for f in os.listdir(record) if f.startswith(f"samples-rank{rank}-")]
    return max((sum(1 for _ in open(os.path.join(record, f))) for f in files), default=0)


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """A CPU-less head and two 1-CPU worker nodes, shared by the lost-node tests: each kills one
    node and adds one, so the next finds two alive again."""
    with LocalRayCluster(tmp_path_factory.mktemp("ray")) as cluster:
        cluster.add_node(cpus=1)
        cluster.add_node(cpus=1)
        yield cluster


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_lost_node_shrinks_the_run_and_new_capacity_grows_it_back(parallelism, request, two_node_cluster, tmp_path):
    """2 workers on two 1-CPU nodes; the node of rank 1 is SIGKILLed mid-epoch; later a node joins.

    Every global batch of the plan is trained on exactly once, in order, across the three world
    sizes (2, 1, 2). The weights cannot be bitwise those of the uninterrupted run: with one
    worker, gradients are summed in another order and the augmentation-like noise comes from RNG
    streams re-derived for the new ranks. So the loss is compared: over the last epoch its mean
    must be within 10% of the uninterrupted run's (the session's reference of the same parallelism).
    """
    # The first attempt holds at step 8 until its node is killed; the one-worker attempt holds at step
    # 16 until Ray's resize check (every 2 s here) sees the new node and replaces it, so the run ends
    # on two workers again however slow the machine is.
    reference = request.getfixturevalue("reference" if parallelism == "ddp" else "fsdp_reference")
    record = tmp_path / "rec"
    holds = [{"world_size": 2, "at_step": 8, "until": "replaced"},
             {"world_size": 1, "at_step": 16, "until": "replaced"}]
    config = trainlib.job_config(record, holds=holds, parallelism=parallelism)
    cluster = two_node_cluster
    wait_until(lambda: len(cluster.alive_nodes()) == 3, timeout=60, what="the head and two nodes alive")
    driver = _driver(cluster.address, cluster.env, tmp_path / "storage", "elastic", (1, 2), config, tmp_path,
                     "driver")

    def rank1_trained(steps: int) -> bool:
        assert driver.running(), driver.output()[-5000:]
        return _steps_recorded(record, 1) >= steps

    wait_until(lambda: rank1_trained(8), timeout=300, what="rank 1 to train 8 steps")
    rank1_node = trainlib.read_attempts(str(record), rank=1)[0]["node_id"]
    next(n for n in cluster.nodes if n.node_id == rank1_node).kill()

    def shrunk() -> bool:
        assert driver.running(), driver.output()[-5000:]
        return [a["world_size"] for a in trainlib.read_attempts(str(record))] == [2, 1]

    wait_until(shrunk, timeout=300, what="the run to restart on the remaining node")
    cluster.add_node(cpus=1)
    driver.wait(timeout=300)
    attempts = trainlib.read_attempts(str(record))
    assert [a["world_size"] for a in attempts] == [2, 1, 2], attempts
    kept = trainlib.kept_global_batches(str(record))
    expected = planned_global_batches(config["samples"], config["global_batch"], config["seed"], config["epochs"])
    assert [kept[step] for step in sorted(kept)] == expected  # every sample exactly once per epoch
    assert sorted(kept) == list(range(1, len(expected) + 1))
    per_epoch = len(expected) // config["epochs"]
    losses = trainlib.kept_losses(str(record))
    last_epoch = [losses[s] for s in range(len(expected) - per_epoch + 1, len(expected) + 1)]
    reference_losses = trainlib.kept_losses(str(reference["record"]))
    reference_last = [reference_losses[s] for s in range(len(expected) - per_epoch + 1, len(expected) + 1)]
    mean, reference_mean = sum(last_epoch) / per_epoch, sum(reference_last) / per_epoch
    assert abs(mean - reference_mean) <= 0.10 * reference_mean, (mean, reference_mean)


def test_a_second_driver_is_refused_at_once_and_a_driver_started_again_resumes_the_run(reference, ray_cluster,
                                                                                    driver_env, tmp_path):
    """Drivers of one run name and storage path. While the first runs, a second stops at its first
    restore with an error naming the first run (which holds the run directory's lease), having
    trained and written nothing; the first trains on untouched. Then the first driver is SIGKILLed
    mid-run; a driver started again resumes from the newest complete checkpoint, and the run ends
    bitwise like the uninterrupted one, every global batch once."""
    storage, record, refused_record = tmp_path / "storage", tmp_path / "rec", tmp_path / "refused"
    refused_record.mkdir()
    refused = tmp_path / "second-refused"
    # The first run holds at step 6 until the second driver has been refused.
    hold = {"world_size": 2, "at_step": 6, "until": str(refused)}
    config = trainlib.job_config(record, step_seconds=0.2, holds=[hold],
                                 lease_ttl_s=trainlib.RESTARTED_DRIVER_LEASE_TTL_S)
    first = _driver(ray_cluster, driver_env, storage, "rerun", 2, config, tmp_path, "first", spare_workers=False)
    wait_until(lambda: first.running() and _steps_recorded(record, 0) >= 6, timeout=300,
               what="the first driver's run to train 6 steps")
    second = _driver(ray_cluster, driver_env, storage, "rerun", 2, {**config, "record_dir": str(refused_record)},
                     tmp_path, "second", spare_workers=False)
    with pytest.raises(DriverError):
        second.wait(timeout=300)
    assert first.running()
    second_output = second.output()
    assert "RunLeaseHeldError" in second_output and "another driver runs this run name" in second_output
    assert trainlib.read_attempts(str(refused_record)) == []  # refused before it trained or wrote anything
    refused.touch()

    wait_until(lambda: first.running() and _steps_recorded(record, 0) >= 12, timeout=300,
               what="the first driver's run to train on to step 12")
    first.kill()
    # Ray stops a dead driver's actors; the run must not go on writing behind the new driver's back.
    old_workers = [a["pid"] for rank in (0, 1) for a in trainlib.read_attempts(str(record), rank)]
    wait_until(lambda: not any(trainlib.alive(pid) for pid in old_workers), timeout=120,
               what="the dead driver's workers to stop")
    newest = [c for c in list_checkpoints(pafs.LocalFileSystem(), str(storage / "rerun")) if c.complete][-1]
    assert newest.step >= 5
    again = _driver(ray_cluster, driver_env, storage, "rerun", 2, config, tmp_path, "again", spare_workers=False)
    final = again.wait(timeout=600)["checkpoint"]
    attempts = trainlib.read_attempts(str(record))
    assert [a["restored_step"] for a in attempts] == [0, newest.step]
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))
    assert trainlib.kept_global_batches(str(record)) == trainlib.kept_global_batches(str(reference["record"]))
    complete = [c for c in list_checkpoints(pafs.LocalFileSystem(), str(storage / "rerun")) if c.complete]
    assert complete[-1].path == final and complete[-1].step == STEPS


@pytest.mark.usefixtures("ray_cluster")
def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path, capfd):
    storage = tmp_path / "storage"
    shutil.copytree(reference["dir"] / "storage" / "reference", storage / "reference")
    *_, previous, newest = list_checkpoints(pafs.LocalFileSystem(), str(storage / "reference"))
    assert newest.step == STEPS
    shard = next(p for p in sorted(os.listdir(newest.path)) if p.endswith(".distcp"))
    with open(os.path.join(newest.path, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(newest.path, shard)) // 2)
    record = tmp_path / "rec"
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(record), str(storage), "reference")
    assert result.error is None
    assert [a["restored_step"] for a in trainlib.read_attempts(str(record))] == [previous.step]
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))
    assert f"Checkpoint {newest.path} failed to load" in capfd.readouterr().err


@pytest.mark.usefixtures("ray_cluster")
def test_exhausted_max_failures_raise_a_clear_error_and_keep_every_committed_checkpoint(tmp_path):
    from ray.train.torch import TorchTrainer

    storage = tmp_path / "storage"
    config = recommended_ray_config("exhausted", str(storage), workers=2, max_failures=1, preload=PRELOAD)
    trainer = TorchTrainer(trainlib.train_fn, train_loop_config=trainlib.job_config(
        tmp_path / "rec", "kill:step=8;kill:durable=10"), **config.trainer_kwargs())
    with pytest.raises(RunFailedError) as failure:
        config.fit(trainer)
    found = list_checkpoints(pafs.LocalFileSystem(), str(storage / "exhausted"))
    checkpoints = [c for c in found if c.complete]
    assert [c.step for c in checkpoints] == [5, 10]
    # A save staged while checkpoint 10 was still being written may be left partial by the kill
    # (it is never loaded, and the next start collects it); nothing older than 10 is.
    assert all(c.step > 10 for c in found if not c.complete)
    # The last attempt died on its writer's thread the moment checkpoint 10 was durable, before its
    # loop collected the save: the ledger, and so the timeline, still marks checkpoint 10 durable.
    events = read_events(pafs.LocalFileSystem(), str(storage / "exhausted"))
    assert 10 in {e["step"] for e in events if e["kind"] == "durable"}
    message = str(failure.value)
    assert "max_failures=1" in message and f"{checkpoints[-1].path} (step 10)" in message
    assert "start the driver again with the same name" in message
    for checkpoint in checkpoints:  # each loads with plain DCP
        model = trainlib.build_model(0).state_dict()
        state = {"model": {k: torch.empty_like(v) for k, v in model.items()}}
        dcp.load(state, checkpoint_id=checkpoint.path)
        assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_the_goodput_ledger_of_a_killed_run_charges_the_recomputed_steps_as_wasted(killed_at_step_8):
    """Rank 1 is killed after step 8; the run resumes from step 5 and recomputes steps 6-8.

    Wasted progress must be those 3 steps as the first attempt trained them: their recorded
    times, to the microsecond (a loaded machine's steps vary too much to compare with the median).
    The parts add up to the wall time from the driver's start to the final checkpoint, and the
    final figures reach ``Result.metrics`` and MLflow.
    """
    from mlflow.tracking import MlflowClient

    from ray_resilient.goodput import account
    from ray_resilient.tracking import RUN_TAG

    result, driver_started, fit_returned = (killed_at_step_8[key] for key in ("result", "driver_started",
                                                                               "fit_returned"))
    assert [a["restored_step"] for a in trainlib.read_attempts(str(killed_at_step_8["record"]))] == [0, 5]
    events = read_events(pafs.LocalFileSystem(), str(killed_at_step_8["run_dir"]))
    breakdown = account(events)
    assert breakdown.steps_recomputed == 3 and breakdown.failures == 1
    steps = [e for e in events if e["kind"] == "step" and e["rank"] == 0]
    first_attempt = steps[:next(i for i, e in enumerate(steps) if i and e["step"] <= steps[i - 1]["step"])]
    lost = [e for e in first_attempt if e["step"] > 5]
    assert [e["step"] for e in lost] == [6, 7, 8]
    assert breakdown.wasted == pytest.approx(sum(e["t"] - e["t_start"] for e in lost), abs=1e-6)
    parts = sum(getattr(breakdown, part) for part in PARTS)
    assert parts == pytest.approx(breakdown.total, abs=1e-6)
    assert events[0]["kind"] == "job_start" and driver_started <= events[0]["t"] <= events[-1]["t"] <= fit_returned
    assert breakdown.total == pytest.approx(events[-1]["t"] - events[0]["t"])
    assert 0 < breakdown.goodput < 1
    assert result.metrics["goodput"] == pytest.approx(breakdown.goodput, abs=0.05)
    client = MlflowClient()
    run = client.search_runs([client.get_experiment_by_name("ray_resilient").experiment_id],
                             f"tags.`{RUN_TAG}` = 'killed-at-8'")[0]
    history = client.get_metric_history(run.info.run_id, "goodput/goodput")
    assert len(history) >= 2 and all(0 < m.value < 1 for m in history)
    assert "goodput/badput_wasted" in run.data.metrics


def watchdog_hears(ranks: list[int]) -> bool:
    """Whether a hang watchdog of the cluster hears exactly ``ranks``."""
    import ray

    watchdogs = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("ray_resilient_watchdog_")]
    for actor in watchdogs:
        try:
            if ray.get(ray.get_actor(actor["name"], actor["namespace"]).heard.remote(), timeout=10) == ranks:
                return True
        except (ValueError, ray.exceptions.RayError):  # not started yet, or gone
            pass
    return False


@pytest.mark.usefixtures("ray_cluster")
def test_a_stopped_worker_is_declared_hung_within_seconds_and_the_run_ends_bitwise(reference, tmp_path):
    """Rank 1 of the test job is SIGSTOPped from outside once it trained 8 steps (0.1 s steps) and
    the watchdog hears both ranks (the ranks train on while it starts: they hold at step 8 until
    the test released them, then the stop lands wherever rank 1 is). Its heartbeats stop; the
    hang watchdog declares it hung once it was silent for 2 s (more where heartbeats arrived late
    on a loaded machine), kills it, and
    Ray restarts the worker group at once (its own worker health check would wait 600 s). The run
    ends bitwise like the uninterrupted one; the ledger, the breakdown and the report show the hang."""
    import signal
    import threading

    from ray_resilient.goodput import account
    from ray_resilient.goodput.report import render_report

    record, storage = tmp_path / "rec", tmp_path / "storage"
    record.mkdir()
    outcome: dict[str, Any] = {}
    heard = tmp_path / "watchdog-hears-both"
    config = trainlib.job_config(record, step_seconds=0.1, holds=[{"world_size": 2, "at_step": 8, "until": str(heard)}])
    run = threading.Thread(target=lambda: outcome.update(result=trainlib.run_job(
        trainlib.train_fn, config, str(storage), "hang", max_failures=1)))
    run.start()
    try:
        wait_until(lambda: _steps_recorded(record, 1) >= 8 and watchdog_hears([0, 1]), timeout=300,
                   what="rank 1 to train 8 steps and the watchdog to hear both ranks")
        heard.touch()
        stopped = trainlib.read_attempts(str(record), rank=1)[0]["pid"]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
    finally:
        run.join(timeout=600)
    assert outcome["result"].error is None
    assert [a["restored_step"] for a in trainlib.read_attempts(str(record))][0] == 0
    assert len(trainlib.read_attempts(str(record))) == 2 and not trainlib.alive(stopped)
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))
    assert trainlib.kept_global_batches(str(record)) == trainlib.kept_global_batches(str(reference["record"]))

    events = read_events(pafs.LocalFileSystem(), str(storage / "hang"))
    hang, = [e for e in events if e["kind"] == "hang"]
    assert hang["hung_rank"] == 1 and hang["pid"] == stopped and "does not answer" in hang["error"]
    assert hang["silent"] and 2.0 <= hang["t"] - hang["t_start"] < 8.0 and hang["t"] - stopped_at < 8.0, hang
    breakdown = account(events)
    assert 0.8 * (hang["t"] - hang["t_start"]) <= breakdown.hang <= hang["t"] - hang["t_start"]
    assert breakdown.failures == 1
    report = render_report(str(storage / "hang"), None)
    assert any(line.split()[:1] == ["hang"] for line in report.splitlines())
    assert f"hang: rank 1 after step {hang['step']}, silent: stopped, or its node lost" in report
