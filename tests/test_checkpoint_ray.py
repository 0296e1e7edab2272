"""Checkpointing inside real Ray Train runs: 2 CPU workers on gloo, real SIGKILLs, real DCP."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed.checkpoint as dcp

import trainlib
from ray_resilient import list_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

def test_uninterrupted_run_registers_complete_checkpoints_and_keeps_num_to_keep(reference):
    result = reference["result"]
    experiment = str(reference["dir"] / "storage" / "reference")
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), experiment)
    restored = [a["restored_step"] for a in trainlib.read_attempts(str(reference["record"]))]
    assert restored == [0], f"the reference run was restarted (attempts restored steps {restored})"
    assert result.metrics["checkpoint_failed_saves"] == 0, f"the reference run failed saves: {result.metrics}"
    # num_to_keep=2 of 5, 10, 15, 20, 24; a save due while both staging sets were still being
    # written (a loaded machine) is deferred to the next step, so the 20th may land on 21-23, or
    # reach step 24 and be the final save, leaving the 15th (or where it landed) before it.
    steps = [c.step for c in checkpoints]
    if result.metrics["checkpoint_deferred_saves"] == 0:
        assert steps == [20, 24], f"{checkpoints}; final metrics {result.metrics}"
    else:
        assert len(steps) == 2 and 15 <= steps[0] < 24 and steps[1] == 24, f"{checkpoints}; {result.metrics}"
    assert all(c.complete for c in checkpoints)
    assert result.checkpoint.path == checkpoints[-1].path
    assert result.metrics["step"] == 24 and result.metrics["checkpoint_failed_saves"] == 0


def test_a_user_hook_hears_every_point_of_the_lifecycle_in_order(reference):
    """``hooks=``: on each rank, the attempt starting with every rank's identity, the restore, each
    step in order, each save's staging at the interval, and the attempt ending without a failure."""
    for rank in (0, 1):
        (points,) = trainlib.read_lifecycle(str(reference["record"]), rank)
        started, *middle, ended = points
        assert started["point"] == "attempt_started" and started["rank"] == rank and started["world_size"] == 2
        assert len(set(started["pids"])) == 2 and ended == {"point": "attempt_ended", "failed": False}
        assert middle[:2] == [{"point": "phase", "name": "restore", "allowance": "startup"},
                              {"point": "phase", "name": "training", "allowance": None}]
        steps = [p["step"] for p in middle if p["point"] == "step_finished"]
        assert steps == list(range(1, 25))
        saved_after = [middle[i - 1]["step"] for i, p in enumerate(middle) if p["point"] == "saving"]
        # At each multiple of the interval, and the step after a save deferred (both staging sets busy);
        # the final save (24) is finish()'s, a phase of its own.
        assert {5, 10, 15, 20} <= set(saved_after) and all(s % 5 == 0 or s - 1 in saved_after for s in saved_after)
        assert {"point": "phase", "name": "final save", "allowance": "startup"} in middle


def test_sigkilled_workers_resume_bitwise_identical(reference, tmp_path):
    # Rank 1 dies mid-interval; later rank 0 dies after checkpoint 20 is durable but before
    # Ray registered it (registration happens at the next save).
    record = tmp_path / "rec"
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(record, "kill:step=12:rank=1;kill:durable=20"),
                              str(tmp_path / "storage"), "killed")
    assert result.error is None
    attempts = trainlib.read_attempts(str(record))
    # The save of step 10 may still be in flight when rank 1 dies at step 12 (it is async). The
    # kill fires at the first save at or after step 20 to become durable: one due while both staging
    # sets are still being written (these steps take milliseconds) waits a step at a time.
    restored = [a["restored_step"] for a in attempts]
    assert restored[:2] in ([0, 5], [0, 10]) and 20 <= restored[2] < 25, restored
    # The third attempt resumed from that checkpoint, which Ray had not registered (Ray may not even
    # have processed the earlier registrations: its controller drains reports every poll).
    registered = attempts[2]["registered"]
    assert registered is None or int(registered.rsplit("/", 1)[-1].split("_")[1]) < restored[2]
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))
    for rank in (0, 1):
        assert trainlib.consumed_samples(str(record), rank) == trainlib.consumed_samples(str(reference["record"]), rank)


@pytest.fixture(scope="module")
def failing_save_run(tmp_path_factory) -> dict:
    """A run whose storage starts with two partial checkpoints (shards without ``.metadata``: saves
    that never finished) and whose rank 1 fails its write of checkpoint 10."""
    root = tmp_path_factory.mktemp("failing-save")
    storage, record = root / "storage", root / "rec"
    for step in (5, 10):
        partial = storage / "failing" / f"checkpoint_{step:010d}_000"
        partial.mkdir(parents=True)
        (partial / "__0_0.distcp").write_bytes(b"half-written")
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(record, "fail_write:upload=10:rank=1"), str(storage),
                              "failing", num_to_keep=None)
    return {"result": result, "record": record, "run_dir": storage / "failing"}


def test_failed_save_is_counted_not_registered_and_training_goes_on(reference, failing_save_run):
    result, record = failing_save_run["result"], failing_save_run["record"]
    assert result.error is None
    assert result.metrics["checkpoint_failed_saves"] == 1
    assert len(trainlib.read_attempts(str(record))) == 1  # no restart
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(failing_save_run["run_dir"]))
    steps = [c.step for c in checkpoints]
    # 10 failed, was never complete, and was collected. A save due while earlier ones are still
    # being written waits a step (checkpoint_deferred_saves), so under load 15 may land at 16.
    assert steps[0] == 5 and steps[-1] == 24 and len(steps) == 4, steps
    assert not any(10 <= step < 15 for step in steps), steps
    assert all(c.complete for c in checkpoints)
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))


def test_partial_checkpoints_only_start_fresh(failing_save_run):
    """Partial checkpoints 5 and 10 of attempt 0 in the run directory: the run starts from scratch
    (nothing to resume from), collects them, and numbers its own attempt after theirs."""
    record, run_dir = failing_save_run["record"], failing_save_run["run_dir"]
    assert failing_save_run["result"].error is None
    assert trainlib.read_attempts(str(record))[0]["restored_step"] == 0
    directories = {p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint_")}
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(run_dir))
    assert directories == {Path(c.path).name for c in checkpoints if c.complete}  # no partial one left
    assert {c.attempt for c in checkpoints} == {1}


def test_a_train_function_that_never_restores_is_stopped_before_it_saves(tmp_path):
    """Without restore() the attempt number is unknown, so a restarted attempt would save over the
    checkpoints of the one before: the first step refuses, naming the missing call."""
    from ray.train import TrainingFailedError

    storage = tmp_path / "storage"
    with pytest.raises(TrainingFailedError) as failure:
        trainlib.run_job(trainlib.no_restore_fn, {}, str(storage), "unrestored", max_failures=0)
    assert "call Checkpointer.restore() before the first step" in str(failure.value)
    assert list_checkpoints(pafs.LocalFileSystem(), str(storage / "unrestored")) == []


def test_three_failed_saves_in_a_row_fail_the_attempt_and_the_restart_trains_on(reference, tmp_path):
    from ray_resilient.goodput import read_events

    record, storage = tmp_path / "rec", tmp_path / "storage"
    plan = ";".join(f"fail_write:upload={step}:rank=1" for step in (5, 10, 15))
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(record, plan), str(storage), "escalating",
                              num_to_keep=None)
    assert result.error is None
    # Saves 5, 10 and 15 failed (each a step later if deferred). Save 20 may have been staged before
    # the third failure was collected (two staging sets) and then completed: the restart resumes
    # from it if so, else from scratch.
    first_attempt = [c.step for c in list_checkpoints(pafs.LocalFileSystem(), str(storage / "escalating"))
                     if c.complete and c.attempt == 0]
    assert len(first_attempt) <= 1 and all(20 <= step < 24 for step in first_attempt), first_attempt
    resumed = first_attempt[0] if first_attempt else 0
    assert [a["restored_step"] for a in trainlib.read_attempts(str(record))] == [0, resumed]
    failures = [e["error"] for e in read_events(pafs.LocalFileSystem(), str(storage / "escalating"))
                if e["kind"] == "failure"]  # the ledger records each rank's error
    assert failures and all(re.search(r"3 checkpoint saves in a row failed \(the last, at step 1[5-9]", f)
                            for f in failures), failures
    assert result.metrics["checkpoint_failed_saves"] == 0
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))


def test_writes_slower_than_the_interval_defer_saves_instead_of_stalling_the_loop(reference, tmp_path):
    from ray_resilient.goodput import read_events

    # Rank 1's write of checkpoint 5 takes 4 s more: checkpoint 10 stages into the second set of
    # buffers at once, and the save due at 15 finds both sets busy. Only rank 1 knows: the ranks
    # must agree on which saves finished. Its write of the final checkpoint (24) takes 10 s more,
    # which every rank waits for without progress: the hang watchdog allows that wait what bounds it
    # (save_timeout_s), not the 6 s it allows the final save here otherwise (its startup allowance).
    slow = 4.0
    record, storage = tmp_path / "rec", tmp_path / "storage"
    faults = f"slow_write:upload=5:rank=1:seconds={slow};slow_write:upload=24:rank=1:seconds=10"
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(record, faults, step_seconds=0.05,
                                                                     watchdog={"startup_allowance_s": 6.0}),
                              str(storage), "slow", num_to_keep=None)
    assert result.error is None and result.metrics["checkpoint_deferred_saves"] >= 1
    assert len(trainlib.read_attempts(str(record))) == 1
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(storage / "slow"))
    assert all(c.complete for c in checkpoints) and [c.step for c in checkpoints][:2] == [5, 10]
    saves = [e for e in read_events(pafs.LocalFileSystem(), str(storage / "slow")) if e["kind"] == "save"]
    assert {e["step"] for e in saves} == {c.step for c in checkpoints}
    # The loop never waited for the slow write (the final save does wait: finish() makes it durable).
    assert max(e["t"] - e["t_start"] for e in saves if e["step"] != 24) < slow / 2
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))


def test_plain_torch_loads_the_model_from_a_checkpoint_directory(reference):
    """The format is standard DCP: a fresh process with only torch reads the model state."""
    checkpoint = reference["result"].checkpoint.path
    script = textwrap.dedent(f"""
        import sys, torch
        import torch.distributed.checkpoint as dcp
        reference = torch.load({str(reference["record"] / "final_weights.pt")!r})
        state = {{"model": {{k: torch.empty_like(v) for k, v in reference.items()}}}}
        dcp.load(state, checkpoint_id={checkpoint!r})
        assert all(torch.equal(state["model"][k], reference[k]) for k in reference)
        assert not any(m.split(".")[0] in ("ray", "ray_resilient") for m in sys.modules), "imported more than torch"
        print("loaded", len(reference), "tensors")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"loaded {len(trainlib.build_model(0).state_dict())} tensors" in out.stdout  # BatchNorm buffers too


def _load_snapshots(record, phase: str, ranks: int) -> list[dict]:
    return [torch.load(record / f"snapshot-{phase}-rank{r}.pt", weights_only=False) for r in range(ranks)]


def _assert_same_state(saved: dict, restored: dict) -> None:
    trainlib.assert_same_weights(saved["model"], restored["model"])
    assert saved["optimizer"]["param_groups"] == restored["optimizer"]["param_groups"]
    for name, per_param in saved["optimizer"]["state"].items():
        for key, value in per_param.items():
            assert torch.equal(value, restored["optimizer"]["state"][name][key]), f"optimizer {name}.{key}"
    assert saved["scheduler"] == restored["scheduler"]
    assert saved["scaler"] == restored["scaler"]
    assert saved["counter"] == restored["counter"]


ROUNDTRIP = {"seed": 3, "steps": 5}


@pytest.fixture(scope="module")
def roundtrip_saved_by(tmp_path_factory):
    """The directory of the round trip's save phase run on ``workers`` workers: run once per worker
    count for the module (the 2-worker save serves the restores on 2 and on 1)."""
    saved = {}

    def saved_by(workers: int):
        if workers not in saved:
            root = tmp_path_factory.mktemp(f"roundtrip-saved-by-{workers}")
            (root / "rec").mkdir()
            result = trainlib.run_job(trainlib.roundtrip_fn, {**ROUNDTRIP, "phase": "save", "record_dir": str(root / "rec")},
                                      str(root / "storage"), "roundtrip", workers=workers, max_failures=0)
            assert result.error is None
            saved[workers] = root
        return saved[workers]

    return saved_by


@pytest.mark.parametrize(("save_workers", "restore_workers"), [(2, 2), (2, 1), (1, 2)])
def test_restore_round_trip_and_resharding(roundtrip_saved_by, tmp_path, save_workers, restore_workers):
    saved_dir, record = roundtrip_saved_by(save_workers), tmp_path / "rec"
    record.mkdir()
    result = trainlib.run_job(trainlib.roundtrip_fn, {**ROUNDTRIP, "phase": "restore", "record_dir": str(record)},
                              str(saved_dir / "storage"), "roundtrip", workers=restore_workers, max_failures=0)
    assert result.error is None
    saved = _load_snapshots(saved_dir / "rec", "save", save_workers)
    restored = _load_snapshots(record, "restore", restore_workers)
    for rank, state in enumerate(restored):
        # BatchNorm buffers are per rank: each rank's own come back; after a resize, rank 0's.
        _assert_same_state(saved[rank] if save_workers == restore_workers else saved[0], state)
        if save_workers == restore_workers:
            # Each rank gets its own RNG streams back (they differ per rank: seeded with the rank).
            assert torch.equal(state["rng"]["torch"], saved[rank]["rng"]["torch"])
            assert state["rng"]["python"] == saved[rank]["rng"]["python"]
            assert (state["rng"]["numpy"][1] == saved[rank]["rng"]["numpy"][1]).all()
        else:
            # Never another rank's RNG state: streams are re-derived instead.
            assert not any(torch.equal(state["rng"]["torch"], old["rng"]["torch"]) for old in saved)
    if save_workers == restore_workers == 2:
        assert not torch.equal(saved[0]["rng"]["torch"], saved[1]["rng"]["torch"])


def test_s3_storage_saves_through_local_disk_and_survives_a_sigkill_during_an_upload(reference, s3_server, tmp_path):
    """Rank 1 dies while uploading checkpoint 10: the restart resumes from 5, skipping the partial
    10, which is collected (every checkpoint left is complete) and replaced by the recomputed one.
    (On local storage, the three seeded kills of test_chaos include a kill during a write.)"""
    fs = s3_server.filesystem()
    record = tmp_path / "rec"
    storage_path = f"{s3_server.bucket}/checkpoint-test"
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(record, "kill:upload=10:rank=1"), storage_path, "s3run",
                              storage_filesystem=fs, num_to_keep=None)
    assert result.error is None
    assert result.checkpoint.filesystem.type_name == "s3"
    assert [a["restored_step"] for a in trainlib.read_attempts(str(record))] == [0, 5]
    checkpoints = list_checkpoints(fs, f"{storage_path}/s3run")
    # Uploads slower than the 5-step interval defer a save by a few steps (when both sets of staging
    # buffers are still uploading): the steps between 10 and 24 depend on the machine.
    assert [(c.step, c.attempt) for c in checkpoints][:2] == [(5, 0), (10, 1)]
    assert (checkpoints[-1].step, checkpoints[-1].attempt) == (24, 1) and all(c.attempt == 1 for c in checkpoints[1:])
    assert all(c.complete for c in checkpoints)
    trainlib.assert_same_weights(trainlib.final_weights(record), trainlib.final_weights(reference["record"]))


def test_auto_interval_is_dalys_for_the_measured_cost_of_a_save_and_step_time(tmp_path):
    from ray_resilient.goodput import read_events

    mtbf = 2.0  # seconds: short, so the 24-step run saves several times
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(tmp_path / "rec", interval="auto", mtbf_s=mtbf,
                                                                     step_seconds=0.05),
                              str(tmp_path / "storage"), "auto", num_to_keep=None)
    assert result.error is None
    events = [e for e in read_events(pafs.LocalFileSystem(), str(tmp_path / "storage" / "auto")) if e["rank"] == 0]
    saves = [e for e in events if e["kind"] == "save"]
    assert saves[0]["step"] == 10 and saves[-1]["step"] == 24  # the first measures the stall; the final one
    # At least one interval chosen between two automatic saves (how many fit depends on the machine).
    assert len(saves) >= 3
    trainlib.assert_auto_intervals(events, mtbf)
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "storage" / "auto"))
    assert [c.step for c in checkpoints] == [s["step"] for s in saves]
    # The run resumed with one more epoch continues at the interval its checkpoint was saved
    # under, instead of measuring again from a first save 10 steps in.
    carried = {"train_state": {"interval_steps": 0}}
    dcp.load(carried, checkpoint_id=checkpoints[-1].path, no_dist=True)
    interval = carried["train_state"]["interval_steps"]
    assert interval >= 1
    result = trainlib.run_job(trainlib.train_fn, trainlib.job_config(tmp_path / "rec", interval="auto", mtbf_s=mtbf,
                                                                     step_seconds=0.05, epochs=3),
                              str(tmp_path / "storage"), "auto", num_to_keep=None)
    assert result.error is None
    events = read_events(pafs.LocalFileSystem(), str(tmp_path / "storage" / "auto"))
    resumed = [e["step"] for e in events if e["kind"] == "save" and e["rank"] == 0 and e["step"] > 24]
    assert resumed[0] == 24 + interval, (resumed, interval)
