"""Restore in one process (no Ray): an unreadable checkpoint is skipped, one that does not fit the job
stops the restore at once, and neither leaves the job running on half-applied state."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import pickle
import shutil

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ray_resilient.checkpoint.layout import checkpoint_dir_name, list_checkpoints
from ray_resilient.checkpoint.restore import (
    IncompatibleCheckpointError,
    NoLoadableCheckpointError,
    find_complete_checkpoints,
    load_newest_loadable,
)
from ray_resilient.checkpoint.state import TrainingComponents, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import AsyncCheckpointWriter
from ray_resilient.faults import FaultInjector


class DataPosition:
    """A data position that, like ``VolumeDataLoader``'s, refuses one saved for another dataset."""

    def __init__(self, dataset: str) -> None:
        self.dataset, self.position = dataset, 0

    def state_dict(self) -> dict:
        return {"dataset": self.dataset, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["dataset"] != self.dataset:
            raise ValueError(f"position saved for dataset {state['dataset']!r}, this job reads {self.dataset!r}")
        self.position = state["position"]


@pytest.fixture
def storage(tmp_path) -> CheckpointStorage:
    return CheckpointStorage(pafs.LocalFileSystem(), str(tmp_path / "run"), str(tmp_path / "local"))


def components(seed: int, hidden: int = 16, scheduler: bool = True, dataset: str = "A") -> TrainingComponents:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.Linear(hidden, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10) if scheduler else None
    return TrainingComponents(model, optimizer, lr_scheduler=lr_scheduler, data=DataPosition(dataset))


def write_checkpoints(storage: CheckpointStorage, steps=(5, 10)) -> None:
    writer = AsyncCheckpointWriter(storage, 0, FaultInjector([], 0, storage.filesystem, "/nonexistent"))
    for step in steps:
        saved = components(step)
        saved.data.position = step
        writer.save(saved.state_to_save(TrainState(step=step), rank=0), step, checkpoint_dir_name(step, 0))
        assert writer.collect()[-1].ok
    writer.close()


def snapshot(job: TrainingComponents) -> dict:
    state = {f"model.{k}": v.clone() for k, v in job.model.state_dict().items()}
    state["scheduler"] = dict(job.lr_scheduler.state_dict()) if job.lr_scheduler else None
    state["position"] = job.data.position
    return state


def assert_untouched(job: TrainingComponents, before: dict) -> None:
    after = snapshot(job)
    assert after.keys() == before.keys()
    for key in before:
        if isinstance(before[key], torch.Tensor):
            assert torch.equal(after[key], before[key]), key
        else:
            assert after[key] == before[key], key


def restore(storage: CheckpointStorage, job: TrainingComponents):
    plan = find_complete_checkpoints(storage, registered_path=None, attempt=1)
    return load_newest_loadable(storage, plan.candidates, job, rank=0, world_size=1, group=None)


@pytest.mark.parametrize("change, named", [
    (dict(dataset="B"), "dataset 'A'"),
    (dict(hidden=32), "shape (16, 8) in it, (32, 8) in the job"),
    (dict(scheduler=False), "it has a lr_scheduler, the job has none"),
])
def test_a_changed_job_stops_the_restore_naming_the_checkpoint_and_touches_nothing(storage, change, named):
    write_checkpoints(storage)
    job = components(99, **change)
    before = snapshot(job)
    with pytest.raises(IncompatibleCheckpointError) as refused:
        restore(storage, job)
    message = str(refused.value)
    assert checkpoint_dir_name(10, 0) in message and named in message and "new run" in message
    assert_untouched(job, before)  # the dataset check runs before the model is read
    assert [c.step for c in list_checkpoints(storage.filesystem, storage.experiment_path) if c.complete] == [5, 10]


def test_an_added_scheduler_stops_the_restore(storage):
    writer_job = components(5, scheduler=False)
    writer = AsyncCheckpointWriter(storage, 0, FaultInjector([], 0, storage.filesystem, "/nonexistent"))
    writer.save(writer_job.state_to_save(TrainState(step=5), rank=0), 5, checkpoint_dir_name(5, 0))
    assert writer.collect()[-1].ok
    writer.close()
    job = components(99)
    before = snapshot(job)
    with pytest.raises(IncompatibleCheckpointError, match="it has no lr_scheduler, the job has one"):
        restore(storage, job)
    assert_untouched(job, before)


def assert_restored_step_5_whole(job: TrainingComponents) -> None:
    assert job.data.position == 5
    expected = components(5)
    for key, value in expected.model.state_dict().items():
        assert torch.equal(job.model.state_dict()[key], value), key


def test_a_truncated_shard_is_unreadable_and_the_previous_checkpoint_loads_whole(storage, tmp_path, caplog):
    write_checkpoints(storage)
    newest = tmp_path / "run" / checkpoint_dir_name(10, 0)
    for manifest in newest.glob("checksums_rank_*.json"):  # as written before checksums
        manifest.unlink()
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    job = components(99)
    loaded = restore(storage, job)
    assert loaded is not None and loaded[1].step == 5
    assert_restored_step_5_whole(job)
    # Refused from .metadata's byte ranges, before any read.
    assert "failed to load" in caplog.text and "outside the file" in caplog.text and "retrying" not in caplog.text


def test_a_read_that_keeps_failing_is_retried_then_the_previous_checkpoint_loads_whole(storage, tmp_path, caplog):
    """The bytes of a pickled value (the scheduler's state) overwritten with garbage of the same
    length, in a checkpoint without checksums: DCP's read fails, is retried, then the checkpoint is
    skipped."""
    write_checkpoints(storage)
    newest = tmp_path / "run" / checkpoint_dir_name(10, 0)
    for manifest in newest.glob("checksums_rank_*.json"):
        manifest.unlink()
    metadata = storage.reader(str(newest)).read_metadata()
    index, info = next((i, v) for i, v in metadata.storage_data.items() if i.fqn.startswith("lr_scheduler"))
    shard = newest / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset:info.offset + info.length] = b"\x00" * info.length
    shard.write_bytes(bytes(data))
    job = components(99)
    loaded = restore(storage, job)
    assert loaded is not None and loaded[1].step == 5
    assert_restored_step_5_whole(job)
    assert "failed to load" in caplog.text and "retrying" in caplog.text


def test_a_flipped_byte_fails_its_checksum_before_anything_loads_and_the_previous_checkpoint_loads(
        storage, tmp_path, caplog):
    write_checkpoints(storage)
    newest = tmp_path / "run" / checkpoint_dir_name(10, 0)
    assert sorted(p.name for p in newest.glob("checksums_rank_*.json")) == ["checksums_rank_0.json"]
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, inside tensor data: DCP itself would load it silently
    shard.write_bytes(bytes(data))
    job = components(99)
    loaded = restore(storage, job)
    assert loaded is not None and loaded[1].step == 5
    for key, value in components(5).model.state_dict().items():
        assert torch.equal(job.model.state_dict()[key], value), key
    assert f"shard {shard.name} fails its checksum" in caplog.text and checkpoint_dir_name(10, 0) in caplog.text


class RunsCode:
    """A value whose unpickling runs code: it creates the file ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = pathlib.Path(marker)

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_a_value_that_would_run_code_when_loaded_is_refused_and_the_previous_checkpoint_loads(
        storage, tmp_path, caplog):
    write_checkpoints(storage, steps=(5,))
    newest = components(10)
    state = newest.state_to_save(TrainState(step=10), rank=0)
    state["rank_state"]["rank_0"]["data"]["position"] = RunsCode(tmp_path / "pwned")
    dcp.save(state, checkpoint_id=str(tmp_path / "run" / checkpoint_dir_name(10, 0)))
    job = components(99)
    assert restore(storage, job)[1].step == 5
    assert not (tmp_path / "pwned").exists()
    assert "Weights only load failed" in caplog.text and checkpoint_dir_name(10, 0) in caplog.text


def test_a_metadata_file_that_would_run_code_when_loaded_is_refused_and_the_previous_checkpoint_loads(
        storage, tmp_path, caplog):
    write_checkpoints(storage)
    metadata_path = tmp_path / "run" / checkpoint_dir_name(10, 0) / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    metadata.storage_meta = RunsCode(tmp_path / "pwned")
    metadata_path.write_bytes(pickle.dumps(metadata))
    job = components(99)
    assert restore(storage, job)[1].step == 5
    assert not (tmp_path / "pwned").exists()
    assert ".metadata refers to pathlib.Path.touch" in caplog.text


def _rewrite_metadata(newest: pathlib.Path, change) -> None:
    metadata = pickle.loads((newest / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn.startswith("model."))
    metadata.storage_data[index] = change(metadata.storage_data[index])
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))


def _add_to_manifest(newest: pathlib.Path, name: str) -> None:
    manifest_path = newest / "checksums_rank_0.json"
    manifest = json.loads(manifest_path.read_text())
    manifest[name] = {"sha256": "0" * 64, "bytes": 1 << 40}
    manifest_path.write_text(json.dumps(manifest))


def _link_a_device(newest: pathlib.Path) -> None:
    (newest / "zero").symlink_to("/dev/zero")
    _add_to_manifest(newest, "zero")


def _huge_world_size(newest: pathlib.Path) -> None:
    """Checkpoint 10 again, saying it was written by a billion ranks."""
    shutil.rmtree(newest)
    saved = components(10)
    state = saved.state_to_save(TrainState(step=10), rank=0)
    state["train_state"]["world_size"] = 10**9
    dcp.save(state, checkpoint_id=str(newest), no_dist=True)


CRAFTED = {  # what a crafted checkpoint 10 does -> the rule its refusal names
    "a .metadata path climbing into another checkpoint": (
        lambda newest: _rewrite_metadata(newest, lambda info: dataclasses.replace(
            info, relative_path=f"../{checkpoint_dir_name(5, 0)}/{info.relative_path}")),
        "only a bare file name"),
    "an absolute .metadata path": (
        lambda newest: _rewrite_metadata(newest, lambda info: dataclasses.replace(info, relative_path="/dev/zero")),
        "only a bare file name"),
    "an offset past the end of the shard": (
        lambda newest: _rewrite_metadata(newest, lambda info: dataclasses.replace(info, offset=1 << 40)),
        "outside the file"),
    "a manifest naming a path out of the checkpoint": (
        lambda newest: _add_to_manifest(newest, "../../../../../../../../dev/zero"), "only a bare file name"),
    "a manifest naming a symlink to a device": (_link_a_device, "not a regular file"),
    "a manifest that is not one": (
        lambda newest: (newest / "checksums_rank_0.json").write_text("[1, 2"), "is not a checksum manifest"),
    "a billion ranks": (_huge_world_size, "10**9"),
}


@pytest.mark.parametrize("craft", sorted(CRAFTED))
def test_a_crafted_checkpoint_is_refused_naming_its_file_and_rule_and_the_previous_one_loads(
        storage, tmp_path, caplog, craft):
    """Write access to a run directory reaches no further: a crafted newest checkpoint reads no
    other file, hashes no device, allocates nothing it names. It is skipped (the previous loads),
    and ``status`` answers too, saying it does not verify."""
    from ray_resilient.status import run_status

    write_checkpoints(storage)
    newest = tmp_path / "run" / checkpoint_dir_name(10, 0)
    make, rule = CRAFTED[craft]
    make(newest)
    job = components(99)
    loaded = restore(storage, job)
    assert loaded is not None and loaded[1].step == 5
    assert_restored_step_5_whole(job)
    rule = "1000000000 ranks" if rule == "10**9" else rule
    assert rule in caplog.text and str(newest) in caplog.text
    verified = {c.step: c.verifies for c in run_status(str(tmp_path / "run")).checkpoints}
    assert verified[5] is True and verified[10] is not True


def test_a_checkpoint_written_before_per_rank_buffers_restores_with_the_model_entrys(storage, tmp_path):
    old = components(5)
    state = old.state_to_save(TrainState(step=5), rank=0)
    del state["rank_state"]["rank_0"]["buffers"]  # the layout before per-rank buffers
    dcp.save(state, checkpoint_id=str(tmp_path / "run" / checkpoint_dir_name(5, 0)))
    job = components(99)
    assert restore(storage, job)[1].step == 5
    for key, value in old.model.state_dict().items():
        assert torch.equal(job.model.state_dict()[key], value), key


def test_when_no_complete_checkpoint_reads_the_restore_fails_instead_of_starting_fresh(storage, tmp_path):
    write_checkpoints(storage)
    for step in (5, 10):
        directory = tmp_path / "run" / checkpoint_dir_name(step, 0)
        for name in os.listdir(directory):
            if name.endswith(".distcp"):
                os.remove(directory / name)
    with pytest.raises(NoLoadableCheckpointError, match="does not start fresh") as failed:
        restore(storage, components(99))
    assert checkpoint_dir_name(5, 0) in str(failed.value) and checkpoint_dir_name(10, 0) in str(failed.value)
