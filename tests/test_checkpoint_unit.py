"""The checkpoint pieces in one process (no Ray): layout, faults, the writer and the fallback restore."""

from __future__ import annotations

import logging
import os
import time

import pyarrow.fs as pafs
import pytest
import torch

from ray_resilient.checkpoint.layout import (
    checkpoint_dir_name,
    delete_partial_checkpoints,
    list_checkpoints,
    parse_checkpoint_dir_name,
)
from ray_resilient.checkpoint.staging import HostStager
from ray_resilient.checkpoint.restore import find_complete_checkpoints, load_newest_loadable
from ray_resilient.checkpoint.session import CheckpointSession
from ray_resilient.checkpoint.state import TrainingComponents, TrainState, own_share
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import AsyncCheckpointWriter
from ray_resilient.faults import Fault, FaultInjector, InjectedFault, parse_faults


@pytest.fixture
def storage(tmp_path) -> CheckpointStorage:
    return CheckpointStorage(pafs.LocalFileSystem(), str(tmp_path / "run"), str(tmp_path / "local"))


def no_faults(storage: CheckpointStorage, plan: str = "", rank: int = 0) -> FaultInjector:
    return FaultInjector(parse_faults(plan), rank, storage.filesystem, f"{storage.experiment_path}/.faults")


def make_components(seed: int) -> TrainingComponents:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return TrainingComponents(model, optimizer)


def save(writer: AsyncCheckpointWriter, components: TrainingComponents, step: int, attempt: int = 0):
    writer.save(components.state_to_save(TrainState(step=step), rank=0), step, checkpoint_dir_name(step, attempt))
    return writer.collect()[-1]


def test_a_save_is_reported_durable_as_soon_as_it_is_not_when_collected(storage):
    """The goodput timeline's durable marker comes from this callback: a process killed before
    its next collection must already have reported its last durable save."""
    import threading
    import time

    reported: list[tuple[int, float, str]] = []
    done = threading.Event()

    def on_durable(step: int, t: float) -> None:
        reported.append((step, t, threading.current_thread().name))
        done.set()

    writer = AsyncCheckpointWriter(storage, 0, no_faults(storage), on_durable=on_durable)
    before = time.time()
    writer.save(make_components(0).state_to_save(TrainState(step=7), rank=0), 7, checkpoint_dir_name(7, 0))
    assert done.wait(60), "no durable report before collect()"
    [(step, t, thread)] = reported
    assert step == 7 and before <= t <= time.time() and thread.startswith("ray_resilient_ckpt")
    assert list_checkpoints(storage.filesystem, storage.experiment_path)[0].complete  # durable means complete
    assert writer.collect()[-1].ok and len(reported) == 1
    failing = AsyncCheckpointWriter(storage, 0, no_faults(storage, "fail_write:upload=9"), on_durable=on_durable)
    assert not save(failing, make_components(0), 9).ok and len(reported) == 1  # a failed save is not reported


def test_checkpoint_names_sort_by_step_then_attempt():
    assert parse_checkpoint_dir_name(checkpoint_dir_name(42, 3)) == (42, 3)
    assert parse_checkpoint_dir_name("checkpoint_2026-11-29_17-00-00.000000") is None
    names = [checkpoint_dir_name(s, a) for s, a in [(10, 1), (9, 2), (10, 0)]]
    assert sorted(names) == [checkpoint_dir_name(9, 2), checkpoint_dir_name(10, 0), checkpoint_dir_name(10, 1)]


def test_partial_collection_keeps_complete_and_newer_partial(storage, tmp_path):
    writer = AsyncCheckpointWriter(storage, 0, no_faults(storage))
    components = make_components(0)
    assert save(writer, components, 5).ok and save(writer, components, 10).ok  # 10 collects nothing
    root = tmp_path / "run"
    for step in (3, 12):
        (root / checkpoint_dir_name(step, 0)).mkdir()
    deleted = delete_partial_checkpoints(storage.filesystem, storage.experiment_path)
    assert [os.path.basename(p) for p in deleted] == [checkpoint_dir_name(3, 0)]
    listed = list_checkpoints(storage.filesystem, storage.experiment_path)
    assert [(c.step, c.complete) for c in listed] == [(5, True), (10, True), (12, False)]
    writer.close()


@pytest.mark.parametrize("staging_buffers", [1, 2])
def test_a_save_needs_a_free_set_of_staging_buffers(storage, staging_buffers):
    writer = AsyncCheckpointWriter(storage, 0, no_faults(storage), staging_buffers=staging_buffers)
    components = make_components(0)
    for step in range(1, staging_buffers + 1):
        writer.save(components.state_to_save(TrainState(step=step), 0), step, checkpoint_dir_name(step, 0))
    assert not writer.can_stage
    with pytest.raises(RuntimeError, match="still being written"):
        writer.save(components.state_to_save(TrainState(step=9), 0), 9, checkpoint_dir_name(9, 0))
    assert [r.step for r in writer.collect()] == list(range(1, staging_buffers + 1))
    assert writer.can_stage and writer.in_flight == 0
    writer.close()


def test_failed_write_is_reported_and_never_complete(storage):
    writer = AsyncCheckpointWriter(storage, 0, no_faults(storage, "fail_write:upload=4"))
    result = save(writer, make_components(0), 4)
    assert not result.ok and "injected storage write failure" in result.error
    assert not list_checkpoints(storage.filesystem, storage.experiment_path)[0].complete
    assert save(writer, make_components(0), 8).ok  # the next interval saves normally
    writer.close()


def test_no_save_writes_into_a_complete_checkpoint(storage, tmp_path):
    writer = AsyncCheckpointWriter(storage, 0, no_faults(storage))
    assert save(writer, make_components(0), 5).ok
    directory = tmp_path / "run" / checkpoint_dir_name(5, 0)
    committed = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in directory.iterdir()}
    result = save(writer, make_components(1), 5)  # other weights under the committed name
    assert not result.ok and f"refusing to write into {directory}: it holds a complete checkpoint" in result.error
    assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in directory.iterdir()} == committed
    writer.close()


@pytest.mark.parametrize("remote", [False, True])
def test_two_writers_of_one_run_never_share_names_and_a_fenced_off_one_writes_nothing(tmp_path, remote, request):
    """A restarted attempt's rank 0 opens the run while the old one still runs (not yet killed):
    the new one saves under a new attempt number, and the old one's next save is refused before
    any of its shards is written or uploaded."""
    if remote:
        server = request.getfixturevalue("s3_server")
        storage = CheckpointStorage(server.filesystem(), f"{server.bucket}/{tmp_path.name}/run", str(tmp_path / "l"))
    else:
        storage = CheckpointStorage(pafs.LocalFileSystem(), str(tmp_path / "run"), str(tmp_path / "local"))
    old, new = (CheckpointSession(storage, 0, no_faults(storage), run_id="run-a") for _ in range(2))
    old_attempt = old.open(None).attempt
    assert save(old._writer, make_components(0), 5, old_attempt).ok
    new_attempt = new.open(None).attempt
    assert new_attempt == old_attempt + 1
    fenced = save(old._writer, make_components(1), 10, old_attempt)
    assert not fenced.ok and "was taken over (lease generation 1)" in fenced.error
    assert save(new._writer, make_components(2), 10, new_attempt).ok
    assert [(c.step, c.attempt, c.complete) for c in list_checkpoints(storage.filesystem, storage.experiment_path)] \
        == [(5, 0, True), (10, 1, True)]
    old.close(RuntimeError("killed"))
    new.close()


def test_a_run_from_before_the_lease_generations_continues_its_attempt_numbers(storage, tmp_path):
    (tmp_path / "run" / checkpoint_dir_name(5, 4)).mkdir(parents=True)
    session = CheckpointSession(storage, 0, no_faults(storage), run_id="run-a")
    assert session.open(None).attempt == 5
    session.close()


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(storage, tmp_path, caplog):
    writer = AsyncCheckpointWriter(storage, 0, no_faults(storage))
    old = make_components(1)
    save(writer, old, 5)
    save(writer, make_components(2), 10)
    writer.close()
    newest = tmp_path / "run" / checkpoint_dir_name(10, 0)
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated shard

    plan = find_complete_checkpoints(storage, registered_path=None, attempt=1)
    assert [c.step for c in plan.candidates] == [10, 5]
    fresh = make_components(3)
    with caplog.at_level(logging.WARNING):
        loaded = load_newest_loadable(storage, plan.candidates, fresh, rank=0, world_size=1, group=None)
    assert loaded is not None and loaded[1].step == 5
    assert "failed to load" in caplog.text and checkpoint_dir_name(10, 0) in caplog.text
    for key, value in old.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[key], value)


def test_only_partial_checkpoints_load_nothing(storage, tmp_path):
    (tmp_path / "run" / checkpoint_dir_name(5, 0)).mkdir(parents=True)
    plan = find_complete_checkpoints(storage, registered_path=None, attempt=1)
    assert plan.candidates == [] and [c.step for c in plan.partial] == [5]
    assert load_newest_loadable(storage, plan.candidates, make_components(0), 0, 1, None) is None


def test_fault_plan_parsing_and_fire_once(storage):
    faults = parse_faults("kill:step=7:rank=1; raise:step=3 ;fail_write:upload=10")
    assert [(f.action, f.point, f.step, f.rank) for f in faults] == [
        ("kill", "step", 7, 1), ("raise", "step", 3, 0), ("fail_write", "upload", 10, 0)]
    assert parse_faults("stop:step=5:rank=2") == [Fault("stop", "step", 5, 2)]
    assert parse_faults("pause:restore=0:seconds=0.5;preempt:step=4") == [
        Fault("pause", "restore", 0, 0, 0.5), Fault("preempt", "step", 4)]
    for bad in ("kill", "kill:step", "explode:step=3", "kill:later=3", "kill:step=3:node=2", "stop:upload=3",
                "pause:step=3", "pause:upload=3:seconds=1", "preempt:upload=3", "kill:step=3:seconds=1",
                "partition:step=3:rank=1", "partition:upload=3:peer=1", "kill:step=3:peer=1",
                "partition:step=3:rank=1:peer=1"):
        with pytest.raises(ValueError, match="bad fault"):
            parse_faults(bad)
    injector = no_faults(storage, "raise:step=3")
    injector.fire("step", 2)
    with pytest.raises(InjectedFault):
        injector.fire("step", 3)
    # A restarted attempt (a new injector over the same run storage) goes past it.
    no_faults(storage, "raise:step=3").fire("step", 3)
    # A checkpoint fault fires on the first save at or after its step (a deferred save lands a step
    # late), once; a step fault only at its step.
    injector = no_faults(storage, "fail_write:upload=15;raise:step=20")
    injector.fire("upload", 10)
    injector.fire("step", 21)
    with pytest.raises(OSError, match="fail_write-upload-15"):
        injector.fire("upload", 16)
    injector.fire("upload", 20)
    # A partition cuts both of its replicas off from each other, after its step, in their processes.
    plan = "partition:step=20:rank=1:peer=2"
    assert parse_faults(plan) == [Fault("partition", "step", 20, 1, peer=2)]
    injectors = [no_faults(storage, plan, rank) for rank in range(3)]
    for injector in injectors:
        injector.fire("step", 19)
        assert injector.unreachable == set()
        injector.fire("step", 20)
    assert [injector.unreachable for injector in injectors] == [set(), {2}, {1}]
    # A pause recurs in every attempt; a preemption notice is taken once.
    for attempt in range(2):
        injector = no_faults(storage, "pause:step=5:seconds=0.2;preempt:step=6")
        started = time.monotonic()
        injector.fire("step", 5)
        assert time.monotonic() - started >= 0.2 and not injector.take_preemption_notice()
        injector.fire("step", 6)
        assert injector.take_preemption_notice() is (attempt == 0) and not injector.take_preemption_notice()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_state_stages_to_pinned_memory_and_round_trips(storage):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    components = TrainingComponents(model, optimizer)
    state = components.state_to_save(TrainState(step=1), rank=0)
    assert "cuda" in state["rank_state"]["rank_0"]["rng"]
    staged = HostStager(pin_memory=True).stage(state)
    assert staged["model"]["weight"].device.type == "cpu" and staged["model"]["weight"].is_pinned()
    assert torch.equal(staged["model"]["weight"], model.weight.detach().cpu())
    writer = AsyncCheckpointWriter(storage, 0, no_faults(storage))
    assert save(writer, components, 1).ok
    writer.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    fresh = torch.nn.Linear(64, 64).cuda()
    restored = TrainingComponents(fresh, torch.optim.Adam(fresh.parameters()))
    plan = find_complete_checkpoints(storage, None, attempt=1)
    assert load_newest_loadable(storage, plan.candidates, restored, 0, 1, None) is not None
    for key, value in expected.items():
        assert torch.equal(restored.model.state_dict()[key], value)


def test_replicated_tensors_are_dealt_to_ranks_disjointly_and_completely():
    tree = {"a": torch.zeros(100), "b": {"c": torch.zeros(60), "d": torch.zeros(50), "n": 3}, "e": torch.zeros(10)}
    shares = [own_share(tree, rank, 2) for rank in range(2)]

    def tensor_names(node, prefix=""):
        names = set()
        for key, value in node.items():
            if isinstance(value, dict):
                names |= tensor_names(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor):
                names.add(f"{prefix}{key}")
        return names

    owned = [tensor_names(share) for share in shares]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == {"a", "b.c", "b.d", "e"}
    assert owned == [{"a", "e"}, {"b.c", "b.d"}]  # 440 bytes each: dealt largest first, by size
    assert all(share["b"]["n"] == 3 for share in shares)  # non-tensors stay everywhere (DCP dedups them)


def test_the_save_interval_rides_in_the_checkpoint_and_a_checkpoint_from_before_it_still_loads(storage):
    """``"auto"`` continues at the interval it had chosen; checkpoints written before the
    train state had that field load with it unrecorded (0)."""
    writer = AsyncCheckpointWriter(storage, 0, no_faults(storage))
    components = make_components(0)
    older = components.state_to_save(TrainState(step=5), rank=0)
    del older["train_state"]["interval_steps"]  # what a checkpoint of the previous version holds
    writer.save(older, 5, checkpoint_dir_name(5, 0))
    writer.collect()
    plan = find_complete_checkpoints(storage, registered_path=None, attempt=1)
    loaded = load_newest_loadable(storage, plan.candidates, make_components(1), 0, 1, None)
    assert loaded is not None and loaded[1].step == 5 and loaded[1].interval_steps == 0
    assert save(writer, components, 9) is not None
    writer.save(components.state_to_save(TrainState(step=12, interval_steps=23), rank=0), 12,
                checkpoint_dir_name(12, 0))
    writer.collect()
    plan = find_complete_checkpoints(storage, registered_path=None, attempt=1)
    loaded = load_newest_loadable(storage, plan.candidates, make_components(1), 0, 1, None)
    assert loaded is not None and (loaded[1].step, loaded[1].interval_steps) == (12, 23)


def test_a_restored_auto_policy_continues_at_its_saved_interval_and_a_fixed_one_keeps_its_own():
    from ray_resilient.checkpoint.save_policy import SavePolicy

    auto = SavePolicy("auto", mtbf_s=600.0)
    auto.restored(30, interval_steps=17)
    assert auto.interval_steps == 17 and [s for s in range(31, 70) if auto.due(s)][:1] == [47]
    fixed = SavePolicy(5)
    fixed.restored(30, interval_steps=17)
    assert fixed.interval_steps == 5 and [s for s in range(31, 41) if fixed.due(s)] == [35, 40]


def test_the_auto_interval_counts_what_a_saves_write_cost_the_steps_beside_it():
    """Two policies see the same steady steps (1 s) and saves (0.2 s of stall); in one, the three
    steps beside each save's write take 1.3 s. That save costs 0.2 + 3 x 0.3 s, and its interval is
    Daly's for that cost (longer), not for the stall alone."""
    from ray_resilient.checkpoint.save_policy import SavePolicy
    from ray_resilient.goodput.planner import interval_steps_for

    intervals = {}
    for slowed in (1.0, 1.3):
        policy = SavePolicy("auto", mtbf_s=3600.0)
        step = 0
        for save in range(3):
            for _ in range(3):  # beside the previous save's write (none before the first save)
                step += 1
                policy.step_finished(slowed if save else 1.0, beside_write=save > 0)
            for _ in range(7):
                step += 1
                policy.step_finished(1.0)
            policy.saved(step, 0.2, 2.0, None)
        intervals[slowed] = policy.interval_steps
    assert intervals[1.0] == interval_steps_for(3600.0, 0.2, 1.0, 2.0)
    assert intervals[1.3] == interval_steps_for(3600.0, 0.2 + 3 * 0.3, 1.0, 2.0) > intervals[1.0]


@pytest.mark.parametrize("interval, mtbf_s, preemption_check_steps, error", [
    (0, None, 10, "interval_steps must be an int >= 1"),
    ("hourly", None, 10, "interval_steps must be an int >= 1"),
    ("auto", None, 10, "needs the job's mtbf_s"),
    (5, None, 0, "preemption_check_steps must be >= 1"),
])
def test_a_save_policy_refuses_settings_it_cannot_follow(interval, mtbf_s, preemption_check_steps, error):
    from ray_resilient.checkpoint.save_policy import SavePolicy

    with pytest.raises(ValueError, match=error):
        SavePolicy(interval, mtbf_s=mtbf_s, preemption_check_steps=preemption_check_steps)


@pytest.mark.parametrize("changes, error", [
    ({"interval_steps": 0}, "interval_steps must be an int >= 1"),
    ({"interval_steps": True}, "interval_steps must be an int >= 1"),
    ({"interval_steps": "auto"}, "needs the job's mtbf_s"),
    ({"staging_buffers": 0}, "staging_buffers must be an int >= 1"),
    ({"write_threads": 2.5}, "write_threads must be an int >= 1"),
    ({"max_failed_saves_in_a_row": 0}, "max_failed_saves_in_a_row must be an int >= 1"),
    ({"save_timeout_s": 0}, "save_timeout_s must be > 0"),
    ({"lease_ttl_s": -1.0}, "lease_ttl_s must be > 0"),
    ({"storage": "/tmp/run"}, "storage must be a CheckpointStorage"),
])
def test_a_checkpoint_config_names_the_knob_it_refuses_and_cannot_be_changed_after(changes, error):
    import dataclasses

    from ray_resilient.checkpoint import CheckpointConfig

    with pytest.raises(ValueError, match=error):
        CheckpointConfig(**changes)
    config = CheckpointConfig(interval_steps=None)
    assert config.replace(interval_steps=7).interval_steps == 7 and config.interval_steps is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.interval_steps = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match=error):
        config.replace(**changes)


def test_without_an_interval_only_the_final_and_preemption_saves_are_made():
    from ray_resilient.checkpoint.save_policy import SavePolicy

    never = SavePolicy(None)
    never.restored(0)
    assert never.interval_steps == 0 and not any(never.due(step) for step in range(1, 1000))


def test_a_fixed_interval_saves_at_its_multiples_and_auto_follows_dalys_interval_after_each_save():
    from ray_resilient.checkpoint.save_policy import AUTO_FIRST_STEPS, SavePolicy
    from ray_resilient.goodput.planner import interval_steps_for

    fixed = SavePolicy(5)
    fixed.restored(7)
    assert [step for step in range(8, 21) if fixed.due(step)] == [10, 15, 20]

    auto = SavePolicy("auto", mtbf_s=600.0)
    auto.restored(30)  # a restored run counts its first interval from the restored step
    assert [step for step in range(31, 31 + AUTO_FIRST_STEPS) if auto.due(step)] == [30 + AUTO_FIRST_STEPS]
    for _ in range(AUTO_FIRST_STEPS):
        auto.step_finished(0.2)
    auto.saved(40, stall_s=0.05, durable_s=0.5, group=None)
    expected = interval_steps_for(600.0, 0.05, 0.2, 0.5)
    assert expected != AUTO_FIRST_STEPS and auto.interval_steps == expected
    assert not auto.due(40 + expected - 1) and auto.due(40 + expected)


def test_a_write_that_hangs_fails_the_saves_it_holds_up_then_escalates(storage):
    """The save of step 5 stalls in its write (3 s, against a save_timeout_s of 0.5 s) with one
    staging set: while it is young the due saves are deferred (a slow save is not a hang); once it
    is older, each due save fails, and the third in a row raises. Waiting for it is bounded too."""
    from ray_resilient.checkpoint.save_outcomes import CheckpointSaveError
    from ray_resilient.checkpoint.session import CheckpointSession
    from ray_resilient.testing import wait_until

    session = CheckpointSession(storage, 0, no_faults(storage, "slow_write:upload=5:seconds=3"), staging_buffers=1,
                                save_timeout_s=0.5, run_id="hung-write")
    storage.filesystem.create_dir(storage.experiment_path)  # Ray creates the run's directory
    session.open(None)
    state = make_components(0).state_to_save(TrainState(step=5), rank=0)
    session.save(state, 5, checkpoint_dir_name(5, 0))
    assert not session.may_save(6) and session.deferred and session.failed == 0
    wait_until(lambda: session._writer.oldest_in_flight()[1] > 0.5, timeout=10, what="the write to pass 0.5 s")
    assert not session.may_save(7) and not session.deferred and session.failed == 1
    assert not session.may_save(8) and session.failed == 2
    with pytest.raises(CheckpointSaveError, match="3 checkpoint saves in a row failed .*the save of step 5 has "
                                                  "been writing for .* save_timeout_s=0.5"):
        session.may_save(9)
    with pytest.raises(CheckpointSaveError, match="save of step 5 has been writing .* storage looks hung") as hung:
        session.collect_all()
    session.close(hung.value)
