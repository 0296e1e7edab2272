"""Survivor mode: replicas SIGKILLed from outside, the others keep training in their processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed.checkpoint as dcp
import trainlib

from ray_resilient import recommended_ray_config
from ray_resilient.checkpoint import list_checkpoints
from ray_resilient.goodput import read_events
from ray_resilient.data import SamplePlan
from ray_resilient.testing import (
    Driver, committed_micro_batches, kept_samples, make_image_volume, read_records, wait_until,
)

pytestmark = pytest.mark.slow

# 480 images on S3 (survivor_volume): 10 global batches of 48 per epoch, 3 micro-batches of 16: 60 steps.
SURVIVOR_JOB = {"seed": 11, "samples": 480, "global_batch": 48, "epochs": 6, "micro_batches": 3, "interval": 10,
                "step_seconds": 0.03}


def fit_survivors(config: dict, storage: Path, name: str, max_failures: int = 4, workers: int = 3,
                  num_to_keep: int | None = None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_resilient.survivors import SurvivorConfig

    trainer = TorchTrainer(trainlib.survivor_fn, train_loop_config=config, torch_config=SurvivorConfig(),
                           scaling_config=ScalingConfig(num_workers=workers),
                           run_config=RunConfig(name=name, storage_path=str(storage),
                                                failure_config=FailureConfig(max_failures=max_failures),
                                                checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep)))
    return trainer.fit()


def records_of(record_dir: Path, **match) -> list[dict]:
    return [r for r in read_records(record_dir) if all(r.get(k) == v for k, v in match.items())]


def pid_of(record_dir: Path, replica: int, not_pid: int | None = None) -> int:
    starts = [r["pid"] for r in records_of(record_dir, kind="start", rank=replica) if r["pid"] != not_pid]
    return starts[-1] if starts else 0


def newest_step(record_dir: Path) -> int:
    return max((r["step"] for r in records_of(record_dir, kind="step")), default=0)


@dataclass(frozen=True)
class SurvivorRun:
    record: Path  # the record_dir of survivor_fn
    run_dir: Path
    result: Any  # ray.train.Result
    job: dict  # its survivor_fn config, less its record: what every other run trains


REFERENCE_MTBF_S = 30.0  # the reference saves at Daly's interval for it: about every 8 steps here


@pytest.fixture(scope="module")
def survivor_volume(s3_server) -> dict[str, str]:
    """480 real JPEGs (3 classes, 8 pixels a side) on the session's S3 server: the survivor job's
    volume (``survivor_fn``'s ``volume``)."""
    root = f"{s3_server.bucket}/volumes/survivors"
    make_image_volume(s3_server.filesystem(), root, classes=3, per_class=SURVIVOR_JOB["samples"] // 3, size=8,
                      seed=SURVIVOR_JOB["seed"])
    return {"uri": f"s3://{root}", "endpoint": f"http://{s3_server.endpoint}", "access_key": s3_server.access_key,
            "secret_key": s3_server.secret_key}


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, survivor_volume, tmp_path_factory) -> SurvivorRun:
    """The survivor job on the S3 volume uninterrupted: the reference every other run must match
    (the interval does not change the training). Its lead saves at the ``"auto"`` interval, logs
    live goodput to MLflow every 5 steps, replica 0's loader its metrics, and Ray keeps 2 checkpoints."""
    root = tmp_path_factory.mktemp("survivors-reference")
    (root / "rec").mkdir()
    job = {**SURVIVOR_JOB, "volume": survivor_volume}
    config = {**job, "record_dir": str(root / "rec"), "interval": "auto", "mtbf_s": REFERENCE_MTBF_S,
              "goodput_logger": "mlflow", "goodput_log_every": 5, "data_logger": "mlflow",
              "volume": {**survivor_volume, "cache_dir": str(root / "cache")}}
    result = fit_survivors(config, root / "storage", "survivor-reference", num_to_keep=2)
    assert result.error is None
    return SurvivorRun(root / "rec", root / "storage" / "survivor-reference", result, job)


def test_the_lead_saves_at_dalys_interval_logs_live_goodput_and_registers_with_ray(uninterrupted):
    """The checkpoint session of survivor mode's lead is Checkpointer's: after a first save 10 steps
    in, each interval is Daly's for the MTBF from the measured cost of a save and step time; the run's
    live goodput reaches MLflow; every durable checkpoint reaches Ray (Result.checkpoint is the
    final one, and num_to_keep=2 deleted all but the newest two: Ray keeps what it never saw)."""
    from mlflow.tracking import MlflowClient

    from ray_resilient.tracking import RUN_TAG

    events = read_events(pafs.LocalFileSystem(), str(uninterrupted.run_dir))
    saves = [e for e in events if e["kind"] == "save"]
    assert saves[0]["step"] == 10 and saves[-1]["step"] == 60 and len(saves) >= 4
    trainlib.assert_auto_intervals([e for e in events if e["rank"] == 0], REFERENCE_MTBF_S)

    client = MlflowClient()
    run, = client.search_runs([client.get_experiment_by_name("ray_resilient").experiment_id],
                              f"tags.`{RUN_TAG}` = 'survivor-reference'")
    history = client.get_metric_history(run.info.run_id, "goodput/goodput")
    assert len(history) >= 10 and all(0 < m.value <= 1 for m in history)
    # Replica 0's loader logs what it waited for and what its node's cache did, as in the mainline.
    logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, "data/fetch_seconds"))
    assert logged[:6] == list(range(5, 31, 5)) and set(logged) <= set(range(5, 61, 5))  # the last may be cut off
    assert client.get_metric_history(run.info.run_id, "data/bytes_downloaded")[-1].value > 0

    # The lead's wait for its loader is counted apart, as in the mainline.
    assert sum(e["data_wait"] for e in events if e["kind"] == "step") > 0

    complete = [c for c in list_checkpoints(pafs.LocalFileSystem(), str(uninterrupted.run_dir)) if c.complete]
    assert [c.step for c in complete] == [s["step"] for s in saves[-2:]]
    assert uninterrupted.result.checkpoint.path == complete[-1].path
    assert [c.path for c, _ in uninterrupted.result.best_checkpoints] == [c.path for c in complete]
    assert uninterrupted.result.metrics["step"] == 60
    # Reported with the final checkpoint: what the train function set, and the run's goodput.
    last = max(records_of(uninterrupted.record, kind="step"), key=lambda r: r["step"])
    assert uninterrupted.result.metrics["loss"] == last["loss"] and 0 < uninterrupted.result.metrics["goodput"] <= 1


def test_survivors_keep_training_through_two_kills_and_end_bitwise_like_an_uninterrupted_run(
        uninterrupted, tmp_path):
    record = tmp_path / "rec"
    record.mkdir()
    storage = tmp_path / "storage"
    released = [tmp_path / "replacement-1-started", tmp_path / "replacement-0-started"]
    # The replicas stream their micro-batches from S3 into a cache of their own (their loaders
    # read in-process: spawned DataLoader workers would cost 4 CPU s each; tests/test_data.py
    # reads micro-batches through workers).
    config = {**uninterrupted.job, "record_dir": str(record), "faults": "slow_write:upload=30:seconds=4",
              "volume": {**uninterrupted.job["volume"], "cache_dir": str(tmp_path / "cache")},
              # The survivors stop at these steps until the test saw the replacement start, so that
              # it joins before the run ends (joining needs steps to be trained).
              "wait_at": [{"step": 20, "until": str(released[0])}, {"step": 40, "until": str(released[1])}]}
    outcome = {}
    run = threading.Thread(target=lambda: outcome.update(result=fit_survivors(config, storage, "survivors")))
    run.start()
    try:
        # Kill 1: replica 1, in the middle of whatever step the replicas are in after step 5.
        wait_until(lambda: newest_step(record) >= 5, timeout=300, what="step 5")
        first = {replica: pid_of(record, replica) for replica in range(3)}
        os.kill(first[1], signal.SIGKILL)
        wait_until(lambda: pid_of(record, 1, not_pid=first[1]), timeout=300, what="replica 1's replacement")
        released[0].touch()
        # Kill 2: the lead (replica 0) while the checkpoint of step 30 is being written in the background.
        checkpoint_30 = storage / "survivors" / "checkpoint_0000000030_000"
        wait_until(checkpoint_30.exists, timeout=300, what="the checkpoint of step 30 being written")
        assert not (checkpoint_30 / ".metadata").exists()
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: pid_of(record, 0, not_pid=first[0]), timeout=300, what="replica 0's replacement")
        released[1].touch()
    finally:
        for path in released:
            path.touch()
        run.join()
    assert outcome["result"].error is None

    # The survivors never left their processes: replica 2 ran in one process from start to end,
    # and each killed replica's first process trained on after the other's kill.
    assert [r["pid"] for r in records_of(record, kind="start", rank=2)] == [first[2]]
    steps_of = defaultdict(list)
    for r in records_of(record, kind="step"):
        steps_of[r["pid"]].append(r["step"])
    assert steps_of[first[2]] == list(range(1, 61))
    survivor_of_kill_1 = steps_of[first[0]]
    # (It was killed while its save of step 30 was being written: inside step 30's train_step, which
    # may have been before it recorded step 30.)
    assert survivor_of_kill_1 == list(range(1, len(survivor_of_kill_1) + 1)) and len(survivor_of_kill_1) >= 29

    # Every sample of every epoch trained exactly once in kept steps: each step committed once per
    # process, all of that step's processes agree on who trained it, and the micro-batches its
    # membership computed for it (the sample ids the loader gave; a replica killed right after
    # the step's exchange computed its part but recorded no commit) are the plan's, all three.
    plan = SamplePlan(SURVIVOR_JOB["samples"], SURVIVOR_JOB["global_batch"], 1, SURVIVOR_JOB["seed"])
    for pid, steps in steps_of.items():
        assert steps == sorted(set(steps)), pid
    by_step = defaultdict(list)
    for r in records_of(record, kind="step"):
        by_step[r["step"]].append(r)
    assert sorted(by_step) == list(range(1, 61))
    records = read_records(record)
    trained = Counter()
    for step, rs in by_step.items():
        assert len({tuple(r["members"]) for r in rs}) == 1, step
        epoch, batch = divmod(step - 1, plan.batches_per_epoch)
        parts = committed_micro_batches(records, rs[0])
        assert sorted(parts) == [0, 1, 2], step
        for part, ids in parts.items():
            assert ids == plan.global_batch_indices(epoch, batch)[part * 16:(part + 1) * 16].tolist()
            trained.update((epoch, i) for i in ids)
    assert set(trained.values()) == {1} and len(trained) == 6 * 480
    assert kept_samples(records) == trained
    assert {len(rs[0]["members"]) for rs in by_step.values()} == {2, 3}  # degraded, then whole again

    # Deterministic reductions: bitwise the whole state of the uninterrupted run (BatchNorm's
    # running statistics included: one update a step, whoever computed its micro-batches), and its losses.
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(uninterrupted.record))
    whole_state = trainlib.final_weights(record)
    assert int(whole_state["1.num_batches_tracked"]) == 60 and whole_state["1.running_mean"].abs().min() > 0
    reference_losses = {r["step"]: r["loss"] for r in records_of(uninterrupted.record, kind="step")}
    assert {step: rs[0]["loss"] for step, rs in by_step.items()} == reference_losses

    # Each replacement's state equals, bitwise, a survivor's at the step it joined.
    replacements = [r for r in records_of(record, kind="joined") if r["pid"] not in first.values()]
    assert sorted(r["rank"] for r in replacements) == [0, 1]
    for joined in replacements:
        assert 0 < joined["step"] < 60
        assert joined["sha"] in {r["sha"] for r in by_step[joined["step"]] if r["pid"] in first.values()}

    # The checkpoint being written by the killed lead never completed; the new lead kept saving.
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(storage / "survivors"))
    assert all(c.complete for c in checkpoints) and 30 not in {c.step for c in checkpoints}
    assert checkpoints[-1].step == 60
    assert outcome["result"].checkpoint.path == checkpoints[-1].path  # registered with Ray, kills or not
    # ... in plain DCP: torch alone loads the final weights from the final checkpoint.
    final = trainlib.final_weights(record)
    loaded = {"model": {key: torch.zeros_like(value) for key, value in final.items()}}
    dcp.load(loaded, checkpoint_id=checkpoints[-1].path, no_dist=True)
    trainlib.assert_same_weights(loaded["model"], final)

    # The ledger has the survivors' events: two memberships lost a replica, two took one in,
    # each replacement copied from a live replica.
    events = read_events(pafs.LocalFileSystem(), str(storage / "survivors"))
    changes = [e for e in events if e["kind"] == "membership"]
    assert [(e["lost"], e["joined"]) for e in changes if e["lost"]] == [([1], []), ([0], [])]
    assert sorted(e["joined"][0] for e in changes if e["joined"]) == [0, 1]
    assert len([e for e in events if e["kind"] == "peer_recovery"]) == 2


def test_the_lead_working_alone_between_steps_longer_than_the_collective_timeout_drops_no_step(
        uninterrupted, tmp_path):
    """After step 20 the lead alone works 8 s (an evaluation of the main job's kind), more than the
    3 s gloo waits here: the others wait for it outside their collectives (the coordinator's
    store), so no step is dropped, no membership changes, and the run ends bitwise like the
    uninterrupted one."""
    record = tmp_path / "rec"
    record.mkdir()
    config = {**uninterrupted.job, "record_dir": str(record), "timeout_s": 3.0,
              "volume": {**uninterrupted.job["volume"], "cache_dir": str(tmp_path / "cache")},
              "wait_at": [{"step": 20, "lead_alone": 8.0}]}
    result = fit_survivors(config, tmp_path / "storage", "lead-alone", max_failures=0)
    assert result.error is None
    events = read_events(pafs.LocalFileSystem(), str(tmp_path / "storage" / "lead-alone"))
    assert not [e for e in events if e["kind"] == "step_discarded"]
    assert not [e for e in events if e["kind"] == "membership" and e["lost"]]
    lead = pid_of(record, 0)
    times = {r["step"]: r["t"] for r in records_of(record, kind="step", pid=pid_of(record, 1))}
    assert times[21] - times[20] >= 8.0  # the others did wait for the lead
    assert [r["step"] for r in records_of(record, kind="step", pid=lead)] == list(range(1, 61))
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(uninterrupted.record))


def test_a_pair_of_replicas_that_cannot_reach_each_other_loses_one_and_the_rest_train_on(uninterrupted, tmp_path):
    """After step 20, replicas 1 and 2 can no longer reach each other, though both reach the
    coordinator and replica 0 (an injected partition: their exchanges and the groups they form
    together fail). Once the pair alone failed to form the group twice, replica 2 is left out;
    replicas 0 and 1 train on (Ray replaces replica 2's process, which may join before the end),
    and the run ends bitwise like the uninterrupted one (re-forming with both would fail until
    every replica gave up)."""
    record = tmp_path / "rec"
    record.mkdir()
    storage = tmp_path / "storage"
    config = {**uninterrupted.job, "record_dir": str(record), "faults": "partition:step=20:rank=1:peer=2",
              "volume": {**uninterrupted.job["volume"], "cache_dir": str(tmp_path / "cache")}}
    result = fit_survivors(config, storage, "partition", max_failures=1)
    assert result.error is None
    events = read_events(pafs.LocalFileSystem(), str(storage / "partition"))
    changes = [(e["lost"], e["joined"]) for e in events if e["kind"] == "membership" and (e["lost"] or e["joined"])]
    assert changes[0] == ([2], []) and all(change == ([], [2]) for change in changes[1:]), changes
    steps = [r["step"] for r in records_of(record, kind="step", pid=pid_of(record, 0))]
    assert steps == list(range(1, 61))  # the lead never left its process
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(uninterrupted.record))


def fit_survivors_in_driver(config: dict) -> dict:
    """Runs in a driver process: ``survivor_fn`` with the recommended configuration in survivor mode."""
    import ray
    from ray.train.torch import TorchTrainer

    ray.init(address=config["address"])
    ray_config = recommended_ray_config(config["name"], config["storage"], workers=3, max_failures=3,
                                        survivors=True, spare_workers=False)
    result = ray_config.fit(TorchTrainer(trainlib.survivor_fn, train_loop_config=config["loop"],
                                         **ray_config.trainer_kwargs()))
    assert result.error is None, result.error
    return {}


def test_a_killed_driver_resumes_from_the_newest_checkpoint_that_reads_all_replicas_from_one_read(
        uninterrupted, ray_cluster, driver_env, tmp_path):
    """The driver is killed after step 25; checkpoint 20, the newest complete one, is damaged (a
    shard file truncated) before the driver is started again. The replica that reads it fails,
    falls back to checkpoint 10, and the others copy that: every replica starts from the same
    state (no silent divergence), and the run ends bitwise like the uninterrupted one."""
    record, storage = tmp_path / "rec", tmp_path / "storage"
    record.mkdir()
    released = tmp_path / "released"
    loop = {**uninterrupted.job, "record_dir": str(record), "wait_at": [{"step": 25, "until": str(released)}],
            "lease_ttl_s": trainlib.RESTARTED_DRIVER_LEASE_TTL_S}
    config = {"name": "survivors", "storage": str(storage), "loop": loop, "address": ray_cluster}
    first = Driver.start("test_survivors:fit_survivors_in_driver", config, env=driver_env, workdir=tmp_path,
                         name="first")
    wait_until(lambda: first.running() and newest_step(record) >= 25, timeout=300, what="step 25")
    first.kill()
    first_pids = {r["pid"] for r in records_of(record, kind="start")}
    wait_until(lambda: not any(trainlib.alive(pid) for pid in first_pids), timeout=120,
               what="the dead driver's workers")
    newest = [c for c in list_checkpoints(pafs.LocalFileSystem(), str(storage / "survivors")) if c.complete][-1]
    assert newest.step == 20
    shard = next(f for f in Path(newest.path).iterdir() if f.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-1])
    released.touch()
    Driver.start("test_survivors:fit_survivors_in_driver", config, env=driver_env, workdir=tmp_path,
                 name="second").wait(timeout=600)
    restarted = [r for r in records_of(record, kind="joined") if r["pid"] not in first_pids]
    assert sorted(r["rank"] for r in restarted) == [0, 1, 2] and {r["step"] for r in restarted} == {10}
    assert len({r["sha"] for r in restarted}) == 1  # one replica read the checkpoint, the others copied it
    restores = [e["step"] for e in read_events(pafs.LocalFileSystem(), str(storage / "survivors"))
                if e["kind"] == "restore"]
    assert restores == [0, 10]
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(uninterrupted.record))


def committed_files(run_dir: Path) -> dict[str, tuple[str, int]]:
    """Every file of the run's complete checkpoints: its SHA-256 and modification time."""
    return {f"{Path(c.path).name}/{f.name}": (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
            for c in list_checkpoints(pafs.LocalFileSystem(), str(run_dir)) if c.complete
            for f in Path(c.path).iterdir()}


@dataclass
class HeldRun:
    """A 2-replica survivor run in a thread, its replicas stopped after step ``hold_at`` until released."""

    record: Path
    storage: Path
    released: Path
    thread: threading.Thread
    outcome: dict

    @classmethod
    def launch(cls, tmp_path: Path, job: dict, name: str, hold_at: int, num_to_keep: int | None = None,
               **loop) -> "HeldRun":
        """Start ``job`` (a :class:`SurvivorRun`'s, or ``SURVIVOR_JOB``); returns at once."""
        record, storage, released = tmp_path / "rec", tmp_path / "storage", tmp_path / "released"
        record.mkdir()
        config = {**job, "record_dir": str(record), "wait_at": [{"step": hold_at, "until": str(released)}], **loop}
        outcome: dict = {}
        thread = threading.Thread(target=lambda: outcome.update(
            result=fit_survivors(config, storage, name, workers=2, num_to_keep=num_to_keep)))
        thread.start()
        return cls(record, storage / name, released, thread, outcome)

    @classmethod
    def start(cls, tmp_path: Path, job: dict, name: str, hold_at: int, **loop) -> "HeldRun":
        """Start it; returns once the replicas trained step ``hold_at``."""
        held = cls.launch(tmp_path, job, name, hold_at, **loop)
        try:
            wait_until(lambda: newest_step(held.record) >= hold_at, timeout=300, what=f"step {hold_at}")
        except TimeoutError:
            held.release()
            raise
        return held

    def release(self) -> Any:
        """Let the replicas go on; the run's result once it ended (None if not within 600 s)."""
        self.released.touch()
        self.thread.join(timeout=600)
        return self.outcome.get("result")


def assert_resumed_from_storage_and_ended_like_the_reference(record: Path, storage: Path, committed: dict,
                                                             replacement_pid: int, uninterrupted: SurvivorRun) -> None:
    """The replacement that was left without a replica holding state read checkpoint 10 from
    storage under a new attempt number; nothing committed was written over; bitwise the reference."""
    assert [r["step"] for r in records_of(record, kind="joined", pid=replacement_pid)] == [10]
    assert committed and all(committed_files(storage)[name] == seen for name, seen in committed.items())
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(storage))
    assert all(c.complete for c in checkpoints) and checkpoints[-1].step == 60
    assert {c.attempt for c in checkpoints if c.step > 10} == {1}
    restores = [e["step"] for e in read_events(pafs.LocalFileSystem(), str(storage)) if e["kind"] == "restore"]
    assert restores == [0, 10]
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(uninterrupted.record))


def test_the_only_replica_with_state_killed_while_copying_it_leaves_the_others_to_restore_from_storage(
        uninterrupted, tmp_path):
    """Replica 1 dies after step 12; replica 0, alone, copies its state to 1's replacement and is
    killed in the middle of the copy (a fault of the copy). The replacement holds no state: it must
    not train on from step 0 under the run's first attempt number (writing over its checkpoints)."""
    # Replica 0 stops after step 15 until the replacement started, so that it copies.
    held = HeldRun.start(tmp_path, uninterrupted.job, "copy", 15, faults="kill:step=12:rank=1;kill:copy=12:rank=0")
    try:
        killed = pid_of(held.record, 1)
        wait_until(lambda: pid_of(held.record, 1, not_pid=killed), timeout=300, what="replica 1's replacement")
        replacement = pid_of(held.record, 1, not_pid=killed)
        committed = committed_files(held.storage)
    finally:
        result = held.release()
    assert result is not None and result.error is None
    assert "kill-copy-12-rank0" in {p.name for p in (held.storage / ".faults").iterdir()}
    assert_resumed_from_storage_and_ended_like_the_reference(held.record, held.storage, committed, replacement,
                                                             uninterrupted)


def test_the_last_replica_with_state_lost_while_a_replacement_waits_leaves_it_to_restore_from_storage(
        uninterrupted, tmp_path):
    """Replica 1 is killed while replica 0 stands after step 15; its replacement waits to be taken
    in at a step boundary; then replica 0 is killed too (another of Ray's health-check polls).
    Nobody would ever take the replacement in: it must not wait forever."""
    held = HeldRun.start(tmp_path, uninterrupted.job, "waiting", 15)
    try:
        first = {replica: pid_of(held.record, replica) for replica in range(2)}
        os.kill(first[1], signal.SIGKILL)
        wait_until(lambda: pid_of(held.record, 1, not_pid=first[1]), timeout=300, what="replica 1's replacement")
        replacement = pid_of(held.record, 1, not_pid=first[1])
        committed = committed_files(held.storage)
        os.kill(first[0], signal.SIGKILL)
    finally:
        result = held.release()
    assert result is not None and result.error is None
    assert_resumed_from_storage_and_ended_like_the_reference(held.record, held.storage, committed, replacement,
                                                             uninterrupted)


def test_a_replica_lost_after_the_last_step_is_replaced_and_registers_the_final_checkpoint_with_the_others(
        uninterrupted, tmp_path):
    """Replica 1 SIGKILLed from outside after the last step, while both stand there: the lead makes
    its final checkpoint durable without it, then waits for Ray's replacement, which joins a
    finished run and registers the final checkpoint with the lead: ``Result.checkpoint`` is the
    final one, with the run's metrics, not an older one (nor none)."""
    held = HeldRun.start(tmp_path, uninterrupted.job, "end", 60)
    try:
        killed = pid_of(held.record, 1)
        os.kill(killed, signal.SIGKILL)
        wait_until(lambda: not trainlib.alive(killed), timeout=60, what="the killed replica to be gone")
    finally:
        result = held.release()
    assert result is not None and result.error is None
    [replacement] = [r for r in records_of(held.record, kind="joined", rank=1) if r["pid"] != killed]
    assert replacement["step"] == 60 and replacement["finished"]
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(held.storage))
    assert checkpoints[-1].step == 60 and checkpoints[-1].complete
    assert result.checkpoint.path == checkpoints[-1].path
    assert result.metrics["step"] == 60 and "loss" in result.metrics and 0 < result.metrics["goodput"] <= 1
    trainlib.assert_same_weights(trainlib.final_weights(held.record), trainlib.final_weights(uninterrupted.record))


def fit_survivors_refused(config: dict, storage: Path, name: str) -> BaseException:
    """A second driver's survivor run of the same name (another ``fit()``: another Ray Train run id)."""
    from ray.train.torch import TorchTrainer

    ray_config = recommended_ray_config(name, str(storage), workers=1, max_failures=2, survivors=True,
                                        spare_workers=False)
    with pytest.raises(Exception) as refused:
        ray_config.fit(TorchTrainer(trainlib.survivor_fn, train_loop_config=config, **ray_config.trainer_kwargs()))
    return refused.value


def test_a_stopped_replica_is_dropped_within_seconds_and_replaced_and_a_second_run_of_the_name_is_refused(
        uninterrupted, tmp_path, monkeypatch):
    """Replica 1 SIGSTOPped from outside while training: its sockets stay open and no FIN ever comes,
    so only its silence tells. The survivor commits its next step within the liveness timeout plus
    a step (not after gloo's 30 s timeout and more); Ray replaces the stopped replica after its
    worker health-check timeout (lowered here, which shows the setting reaches Ray Train's
    controller). Meanwhile the lead's checkpoint of step 5 takes 5 s to write: a slow write must
    not stall the lead's steps, nor so make another replica drop one (only the stopped replica is
    ever lost). While the run stands after step 30, a second run of its name is refused, survivor
    or ``Checkpointer``, before its first step. The run then ends bitwise like the uninterrupted one."""
    from ray.train import TrainingFailedError

    from ray_resilient import RunLeaseHeldError
    monkeypatch.setenv("RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", "8")
    # The survivor stops after step 30 until the replacement started, so that it joins before the end.
    held = HeldRun.launch(tmp_path, uninterrupted.job, "stopped", 30, interval=5,
                          faults="slow_write:upload=5:seconds=5")
    record, storage = held.record, held.storage
    stopped = 0
    try:
        wait_until(lambda: newest_step(record) >= 5, timeout=300, what="step 5")
        stopped = pid_of(record, 1)
        os.kill(stopped, signal.SIGSTOP)
        wait_until(lambda: pid_of(record, 1, not_pid=stopped), timeout=300, what="replica 1's replacement")
        wait_until(lambda: newest_step(record) >= 30, timeout=300, what="step 30")
        other = tmp_path / "other"
        other.mkdir()
        refused = fit_survivors_refused({**uninterrupted.job, "record_dir": str(other)}, storage.parent, "stopped")
        assert isinstance(refused, RunLeaseHeldError) and "is in use by Ray Train run" in str(refused)
        with pytest.raises(TrainingFailedError, match="is in use by Ray Train run"):
            trainlib.run_job(trainlib.train_fn, trainlib.job_config(tmp_path / "checkpointer"), str(storage.parent),
                             "stopped", workers=1, max_failures=0)
        assert newest_step(other) == 0  # refused before its first step
    finally:
        held.released.touch()
        if stopped:
            with contextlib.suppress(ProcessLookupError):  # Ray killed it when it replaced it
                os.kill(stopped, signal.SIGCONT)
        result = held.release()
    assert result is not None and result.error is None
    survivor = pid_of(record, 0)
    times = [r["t"] for r in records_of(record, kind="step", pid=survivor) if r["step"] <= 30]
    step_s = sorted(b - a for a, b in zip(times, times[1:]))[len(times) // 2]
    pause = max(b - a for a, b in zip(times, times[1:]))
    # The silence (2 s, up to about 5 s where this loaded machine's heartbeats came late), re-forming.
    assert pause < 5.0 + step_s + 2.0, pause
    events = read_events(pafs.LocalFileSystem(), str(storage))
    assert [e["lost"] for e in events if e["kind"] == "membership" and e["lost"]] == [[1]]
    assert [r["step"] for r in records_of(record, kind="step", pid=survivor)] == list(range(1, 61))
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(storage))
    assert checkpoints[0].step == 5 and all(c.complete for c in checkpoints) and checkpoints[-1].step == 60
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(uninterrupted.record))


def test_failed_saves_escalate_in_survivor_mode_and_a_failed_final_save_is_made_again(uninterrupted, tmp_path):
    """The lead's saves 10, 20 and 30 fail: at the third in a row it stops (another replica takes
    over as the lead, as a restart would in the mainline). The new lead's final save fails once:
    it is made again from memory, and the run ends with its final checkpoint durable."""
    record, storage = tmp_path / "rec", tmp_path / "storage"
    record.mkdir()
    faults = ";".join(f"fail_write:upload={step}:rank=0" for step in (10, 20, 30)) + ";fail_write:upload=60:rank=1"
    result = fit_survivors({**uninterrupted.job, "record_dir": str(record), "faults": faults}, storage, "saves",
                           workers=2)
    assert result.error is None
    first_lead = records_of(record, kind="start", rank=0)[0]["pid"]
    steps_of_first_lead = [r["step"] for r in records_of(record, kind="step", pid=first_lead)]
    assert 30 <= steps_of_first_lead[-1] < 40 and not records_of(record, kind="finished", pid=first_lead)
    run_dir = storage / "saves"
    assert "fail_write-upload-60-rank1" in {p.name for p in (run_dir / ".faults").iterdir()}
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(run_dir))
    # The new lead's lease generation (attempt 1) names its checkpoints: the first lead's names are never reused.
    assert [(c.step, c.attempt) for c in checkpoints if c.complete] == [(40, 1), (50, 1), (60, 1)]
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(uninterrupted.record))


def test_survivor_mode_takes_what_checkpointer_takes_and_answers_a_preemption_with_a_save(ray_cluster, tmp_path):
    """The lead runs the mainline's checkpoint loop: a GradScaler and an extra Stateful train alike on
    both replicas and go into its checkpoints, which go to the job's own storage; a preemption
    notice after step 4 is answered by a save of step 5 (the interval saves nothing: None);
    ``progress()`` is there as in the mainline."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ray_resilient.survivors import SurvivorConfig

    record, own = tmp_path / "rec", tmp_path / "own-storage"
    record.mkdir()
    config = {"seed": 3, "samples": 64, "global_batch": 8, "steps": 8, "record_dir": str(record),
              "storage": str(own / "run"), "faults": "preempt:step=4:rank=0"}
    trainer = TorchTrainer(trainlib.survivor_components_fn, train_loop_config=config, torch_config=SurvivorConfig(),
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="components", storage_path=str(tmp_path / "ray"),
                                                failure_config=FailureConfig(max_failures=0)))
    assert trainer.fit().error is None
    finals = [json.loads((record / f"replica{r}.json").read_text()) for r in (0, 1)]
    # 8 steps without an inf: the scale doubled every 2 (2^8 -> 2^12) on both replicas; the counter alike.
    assert finals[0] == finals[1] == {"scale": 2.0**12, "counter": finals[0]["counter"], "step": 8}
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(own / "run"))
    assert [(c.step, c.complete) for c in checkpoints] == [(5, True), (8, True)]
    assert not list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "ray" / "components"))
    events = read_events(pafs.LocalFileSystem(), str(own / "run"))
    assert [e["step"] for e in events if e["kind"] == "save"] == [5, 8]
    dcp_to_torch_save(checkpoints[-1].path, tmp_path / "final.pt")
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    assert final["grad_scaler"]["scale"] == 2.0**12 and final["extras"]["counter"] == {"value": finals[0]["counter"]}
    assert final["train_state"]["step"] == 8


# SURVIVOR_JOB with no volume trains on SyntheticBatches: no S3 volume and no reference run needed.


def test_a_registration_ray_skipped_as_it_replaced_a_replica_is_offered_again_and_num_to_keep_deletes_it(
        ray_cluster, tmp_path):
    """Replica 1 is killed as it is about to register checkpoint 10 with Ray (a fault of the
    registration): the lead's report waits at Ray's barrier, which Ray resets when it replaces
    replica 1, skipping the report. The replacement says which checkpoint Ray had as it started,
    and once it is taken in (the lead stands after step 30 until it started) the lead offers 10
    again: Ray registers every checkpoint, and num_to_keep=2 leaves the newest two (the skipped
    one was never registered, so never deleted)."""
    held = HeldRun.start(tmp_path, SURVIVOR_JOB, "skipped", 30, num_to_keep=2, faults="kill:register=10:rank=1")
    try:
        killed = records_of(held.record, kind="start", rank=1)[0]["pid"]
        wait_until(lambda: pid_of(held.record, 1, not_pid=killed), timeout=300, what="replica 1's replacement")
    finally:
        result = held.release()
    assert result is not None and result.error is None
    assert "kill-register-10-rank1" in {p.name for p in (held.storage / ".faults").iterdir()}
    complete = [c for c in list_checkpoints(pafs.LocalFileSystem(), str(held.storage)) if c.complete]
    assert [c.step for c in complete] == [50, 60]
    assert [c.path for c, _ in result.best_checkpoints] == [c.path for c in complete]
    assert result.checkpoint.path == complete[-1].path


def test_a_lead_lost_after_its_final_checkpoint_became_durable_leaves_the_other_replica_to_finish_the_run(
        ray_cluster, tmp_path):
    """The lead (replica 0) is killed right after its final checkpoint (step 20) became durable,
    before it told the others that the run finished. Replica 1 takes over as the lead in its own
    process: it finds step 20 durable (no second final save), waits for replica 0's replacement and
    finishes the run; nobody raises, and replica 1 never restarts."""
    record, storage = tmp_path / "rec", tmp_path / "storage"
    record.mkdir()
    config = {**SURVIVOR_JOB, "epochs": 2, "record_dir": str(record), "faults": "kill:durable=20:rank=0"}
    result = fit_survivors(config, storage, "lead-end", workers=2)
    assert result.error is None
    run_dir = storage / "lead-end"
    assert "kill-durable-20-rank0" in {p.name for p in (run_dir / ".faults").iterdir()}
    [survivor] = [r["pid"] for r in records_of(record, kind="start", rank=1)]
    assert [r["step"] for r in records_of(record, kind="finished", pid=survivor)] == [20]
    complete = [c for c in list_checkpoints(pafs.LocalFileSystem(), str(run_dir)) if c.complete]
    assert [(c.step, c.attempt) for c in complete] == [(10, 0), (20, 0)]  # the lost lead's final one, not made again
    assert result.checkpoint.path == complete[-1].path and result.metrics["step"] == 20


def test_a_source_stuck_restoring_from_storage_is_given_up_and_the_others_re_form_instead_of_waiting_for_ever(
        ray_cluster, tmp_path):
    """Replica 0, the source of the first membership, stops before it reads for 10 s more than the
    others wait for a restore that makes no progress (RESTORE_STALL_TIMEOUTS x timeout_s): replica 1
    gives the membership up (a read stuck would otherwise hang the group, heartbeats green). Once
    replica 0 is back, the two re-form, nobody lost, it copies its state to replica 1, and both
    train every step in their first processes."""
    from ray_resilient.survivors.membership import RESTORE_STALL_TIMEOUTS

    record, storage = tmp_path / "rec", tmp_path / "storage"
    record.mkdir()
    pause = RESTORE_STALL_TIMEOUTS * 3.0 + 10
    config = {**SURVIVOR_JOB, "epochs": 1, "record_dir": str(record), "timeout_s": 3.0,
              "faults": f"pause:restore=0:rank=0:seconds={pause:g}"}
    result = fit_survivors(config, storage, "stuck-restore", max_failures=0, workers=2)
    assert result.error is None
    events = read_events(pafs.LocalFileSystem(), str(storage / "stuck-restore"))
    assert [(e["lost"], e["joined"]) for e in events if e["kind"] == "membership"] == [([], [])]
    assert len([e for e in events if e["kind"] == "peer_recovery"]) == 1
    for replica in range(2):
        [pid] = [r["pid"] for r in records_of(record, kind="start", rank=replica)]
        assert [r["step"] for r in records_of(record, kind="step", pid=pid)] == list(range(1, 11))
