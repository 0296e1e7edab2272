"""Restore from S3 (a real SeaweedFS) through the node's copy: each shard file fetched once per node and
verified as it streams, a checkpoint this node saved read with no download, a corrupted shard caught (on
S3, or in the node's copy), and a local disk that will not take the files, or fails at any write, costing
only speed."""

from __future__ import annotations

import json
import logging
import os

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from test_fsdp_checkpoint import assert_equal_trees, full_state, sharded_model
from test_restore import assert_restored_step_5_whole, components, restore, write_checkpoints

from ray_resilient.checkpoint.layout import checkpoint_dir_name, list_checkpoints
from ray_resilient.checkpoint.node_copy import DIGEST_SUFFIX, node_copy_dir
from ray_resilient.checkpoint.restore import load_newest_loadable
from ray_resilient.checkpoint.session import CheckpointSession
from ray_resilient.checkpoint.state import TrainingComponents, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import AsyncCheckpointWriter
from ray_resilient.faults import FaultInjector
from ray_resilient.testing.s3_server import S3Server

NAME = checkpoint_dir_name(3, 0)


def s3_storage(server: S3Server, run: str, local_dir: str, **options) -> CheckpointStorage:
    return CheckpointStorage(server.filesystem(), f"{server.bucket}/{run}", local_dir, **options)


def remote_files(storage: CheckpointStorage, name: str) -> dict[str, int]:
    infos = storage.filesystem.get_file_info(pafs.FileSelector(storage.checkpoint_path(name)))
    return {info.base_name: info.size for info in infos}


# --- one process -----------------------------------------------------------------------------


def test_a_restore_reads_the_copy_this_node_saved_without_fetching(s3_server, tmp_path):
    saver = s3_storage(s3_server, "local-first", str(tmp_path / "node"))
    write_checkpoints(saver)
    kept = node_copy_dir(saver.local_dir, checkpoint_dir_name(10, 0))
    shards = sorted(n for n in remote_files(saver, checkpoint_dir_name(10, 0)) if n.endswith(".distcp"))
    assert sorted(n for n in os.listdir(kept) if n.endswith(".distcp")) == shards
    assert not os.path.exists(node_copy_dir(saver.local_dir, checkpoint_dir_name(5, 0)))  # one copy per node
    restarted = s3_storage(s3_server, "local-first", saver.local_dir)
    job = components(99)
    assert restore(restarted, job)[1].step == 10
    assert restarted.fetched.files == [] and restarted.fetched.streamed == []
    for key, value in components(10).model.state_dict().items():
        assert torch.equal(job.model.state_dict()[key], value), key


def test_the_nodes_copy_is_kept_for_a_restart_and_deleted_when_the_run_ends(s3_server, tmp_path):
    storage = s3_storage(s3_server, "run-ends", str(tmp_path / "node"))
    for error in (RuntimeError("a worker died"), None):
        session = CheckpointSession(storage, 0, FaultInjector([], 0, storage.filesystem, "/nonexistent"),
                                    run_id="run-ends")
        session.open(registered_path=None)
        job = components(5)
        session.save(job.state_to_save(TrainState(step=5), rank=0), 5, checkpoint_dir_name(5, int(not error)))
        assert session.collect_all()[-1].ok
        session.close(error)
        copy = node_copy_dir(storage.local_dir, checkpoint_dir_name(5, int(not error)))
        assert os.path.isdir(copy) == (error is not None)  # a restart reads it; a finished run needs none


def test_a_local_copy_whose_checksum_differs_from_the_manifest_is_fetched_again(s3_server, tmp_path):
    saver = s3_storage(s3_server, "stale-copy", str(tmp_path / "node"))
    write_checkpoints(saver)
    kept = node_copy_dir(saver.local_dir, checkpoint_dir_name(10, 0))
    shard = sorted(n for n in os.listdir(kept) if n.endswith(".distcp"))[0]
    with open(os.path.join(kept, shard), "r+b") as out:  # damaged on the node's disk
        out.write(b"\xff")
    with open(os.path.join(kept, shard + DIGEST_SUFFIX), "w") as out:
        out.write("0" * 64)
    restarted = s3_storage(s3_server, "stale-copy", saver.local_dir)
    job = components(99)
    assert restore(restarted, job)[1].step == 10
    assert restarted.fetched.files == [f"{checkpoint_dir_name(10, 0)}/{shard}"]
    for key, value in components(10).model.state_dict().items():
        assert torch.equal(job.model.state_dict()[key], value), key


def test_a_fetched_copy_changed_on_the_nodes_disk_is_caught_by_its_bytes_and_fetched_again(
        s3_server, tmp_path, caplog):
    write_checkpoints(s3_storage(s3_server, "rotten-copy", str(tmp_path / "saver")))
    first = s3_storage(s3_server, "rotten-copy", str(tmp_path / "node"))
    assert restore(first, components(99))[1].step == 10
    kept = node_copy_dir(first.local_dir, checkpoint_dir_name(10, 0))
    shard = max((n for n in os.listdir(kept) if n.endswith(".distcp")),
                key=lambda n: os.path.getsize(os.path.join(kept, n)))
    with open(os.path.join(kept, shard), "r+b") as out:  # its sidecar still matches the manifest
        out.seek(os.path.getsize(os.path.join(kept, shard)) // 2 - 256)
        out.write(bytes(512))
    restarted = s3_storage(s3_server, "rotten-copy", first.local_dir)
    job = components(99)
    with caplog.at_level(logging.WARNING):
        assert restore(restarted, job)[1].step == 10
    assert restarted.fetched.files == [f"{checkpoint_dir_name(10, 0)}/{shard}"]
    assert f"{shard} of checkpoint {checkpoint_dir_name(10, 0)}" in caplog.text and "fetching it again" in caplog.text
    for key, value in components(10).model.state_dict().items():
        assert torch.equal(job.model.state_dict()[key], value), key


def test_a_corrupted_shard_on_s3_is_caught_as_it_streams_and_the_previous_checkpoint_loads(
        s3_server, tmp_path, caplog):
    saver = s3_storage(s3_server, "corrupted", str(tmp_path / "saver"))
    write_checkpoints(saver)
    newest = saver.checkpoint_path(checkpoint_dir_name(10, 0))
    sizes = remote_files(saver, checkpoint_dir_name(10, 0))
    biggest = max((n for n in sizes if n.endswith(".distcp")), key=sizes.get)
    with saver.filesystem.open_input_stream(f"{newest}/{biggest}") as stream:
        data = bytearray(stream.read())
    data[len(data) // 2] ^= 0x01  # one bit inside tensor data, same size: only the checksum sees it
    with saver.filesystem.open_output_stream(f"{newest}/{biggest}") as out:
        out.write(bytes(data))
    other_node = s3_storage(s3_server, "corrupted", str(tmp_path / "other-node"))
    job = components(99)
    loaded = restore(other_node, job)
    assert loaded is not None and loaded[1].step == 5
    assert_restored_step_5_whole(job)
    assert f"shard {biggest} fails its checksum" in caplog.text and "retrying" not in caplog.text
    assert f"{checkpoint_dir_name(10, 0)}/{biggest}" not in other_node.fetched.files  # never placed in the copy
    copies = os.listdir(os.path.join(other_node.local_dir, "checkpoints"))
    assert copies == [checkpoint_dir_name(5, 0)]  # the damaged one's files are gone


def test_a_local_disk_that_will_not_take_the_files_costs_only_speed(s3_server, tmp_path, caplog):
    saver = s3_storage(s3_server, "full-disk", str(tmp_path / "saver"))
    write_checkpoints(saver)
    full = s3_storage(s3_server, "full-disk", str(tmp_path / "full"), min_free_bytes=1 << 62)
    job = components(99)
    with caplog.at_level(logging.WARNING):
        assert restore(full, job)[1].step == 10
    shards = {n for n in remote_files(saver, checkpoint_dir_name(10, 0)) if n.endswith(".distcp")}
    assert full.fetched.files == [] and {f.split("/")[1] for f in full.fetched.streamed} == shards
    warning = node_copy_dir(full.local_dir, checkpoint_dir_name(10, 0))
    assert warning in caplog.text and "min_free_bytes" in caplog.text and "remote storage instead" in caplog.text
    for key, value in components(10).model.state_dict().items():
        assert torch.equal(job.model.state_dict()[key], value), key


def under_a_file(tmp_path, _shards: set[str]) -> str:
    """A local_dir whose directories cannot be created: its parent is a regular file."""
    (tmp_path / "a-file").write_bytes(b"")
    return str(tmp_path / "a-file" / "node")


def digests_on_a_full_disk(tmp_path, shards: set[str]) -> str:
    """A local_dir where each shard's digest is written to /dev/full (its close fails: no space)."""
    copy = node_copy_dir(str(tmp_path / "node"), checkpoint_dir_name(10, 0))
    os.makedirs(copy)
    for shard in shards:
        os.symlink("/dev/full", os.path.join(copy, f"{shard}{DIGEST_SUFFIX}.tmp"))
    return str(tmp_path / "node")


@pytest.mark.parametrize("full_disk", [under_a_file, digests_on_a_full_disk])
def test_a_local_disk_failing_at_any_write_costs_only_speed(s3_server, tmp_path, caplog, full_disk):
    run = f"failing-disk-{full_disk.__name__}"
    saver = s3_storage(s3_server, run, str(tmp_path / "saver"))
    write_checkpoints(saver)
    shards = {n for n in remote_files(saver, checkpoint_dir_name(10, 0)) if n.endswith(".distcp")}
    failing = s3_storage(s3_server, run, full_disk(tmp_path, shards))
    job = components(99)
    with caplog.at_level(logging.WARNING):
        assert restore(failing, job)[1].step == 10
    assert {f.split("/")[1] for f in failing.fetched.streamed} == shards
    assert "remote storage instead" in caplog.text
    for key, value in components(10).model.state_dict().items():
        assert torch.equal(job.model.state_dict()[key], value), key


def test_plain_dcp_load_reads_a_remote_checkpoint_through_a_verified_copy(s3_server, tmp_path, monkeypatch):
    write_checkpoints(s3_storage(s3_server, "interop", str(tmp_path / "saver")))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_server.endpoint}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    storage = CheckpointStorage.from_uri(f"s3://{s3_server.bucket}/interop", local_dir=str(tmp_path / "reader"))
    model = components(99).model
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=storage.reader(storage.checkpoint_path(checkpoint_dir_name(10, 0))))
    model.load_state_dict(state["model"])
    for key, value in components(10).model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert storage.fetched.files and all(f.startswith(checkpoint_dir_name(10, 0)) for f in storage.fetched.files)


# --- process groups on one node ------------------------------------------------------------------


def replicated_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 5))


def run_rank(rank: int, world: int, root: str, server: S3Server, kind: str, phase: str, local: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store-{kind}-{phase}", world), rank=rank,
                            world_size=world)
    try:
        storage = s3_storage(server, f"node-copy-{kind}", f"{root}/{local}")
        faults = FaultInjector([], rank, storage.filesystem, f"{root}/.faults")
        seed = 0 if phase == "save" else 99
        model = sharded_model(seed) if kind == "fsdp" else replicated_model(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        components = TrainingComponents(model, optimizer)
        writer = AsyncCheckpointWriter(storage, rank, faults)
        if phase == "save":
            torch.manual_seed(0 if kind == "ddp" else 1 + rank)  # replicas step alike; shards each their own
            for _ in range(3):
                model(torch.randn(8, 64)).logsumexp(1).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            writer.save(components.state_to_save(TrainState(step=3, world_size=world), rank), 3, NAME)
            assert writer.collect()[-1].ok
        else:
            checkpoints = list(reversed(list_checkpoints(storage.filesystem, storage.experiment_path)))
            loaded = load_newest_loadable(storage, checkpoints, components, rank, world, writer.group)
            assert loaded is not None and loaded[1].step == 3
        full = full_state(model, optimizer) if kind == "fsdp" else {"model": model.state_dict(),
                                                                      "optimizer": optimizer.state_dict()}
        if rank == 0 or kind == "ddp":
            torch.save(full, f"{root}/{kind}-{phase}-{local}-rank{rank}.pt")
        with open(f"{root}/{kind}-{phase}-{local}-fetched{rank}.json", "w") as out:
            json.dump({"files": storage.fetched.files, "streamed": storage.fetched.streamed}, out)
        writer.close()
    finally:
        dist.destroy_process_group()


def spawn(world: int, root: str, server: S3Server, kind: str, phase: str, local: str) -> list[list[str]]:
    """Run ``phase`` on ``world`` ranks of one node (their storage's local_dir: ``local``); returns
    each rank's fetched files."""
    mp.spawn(run_rank, args=(world, root, server, kind, phase, local), nprocs=world, join=True)
    records = []
    for rank in range(world):
        with open(f"{root}/{kind}-{phase}-{local}-fetched{rank}.json") as stream:
            record = json.load(stream)
        assert record["streamed"] == []
        records.append(record["files"])
    return records


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ranks_of_a_node_fetch_each_shard_once_and_restore_bitwise_on_another_number_of_ranks(
        s3_server, tmp_path, kind):
    root = str(tmp_path)
    spawn(2, root, s3_server, kind, "save", "saving-node")
    fetched = spawn(3, root, s3_server, kind, "restore", "fresh-node")
    every = [name for files in fetched for name in files]
    storage = s3_storage(s3_server, f"node-copy-{kind}", root)
    shards = {f"{NAME}/{n}" for n in remote_files(storage, NAME) if n.endswith(".distcp")}
    metadata = storage.reader(storage.checkpoint_path(NAME), fetch=False).read_metadata()
    weights = {f"{NAME}/{info.relative_path}" for index, info in metadata.storage_data.items()
               if index.fqn.startswith(("model.", "optimizer."))}
    assert len(every) == len(set(every)), every  # no file fetched twice on the node
    # Every file holding weights (replicas need them all; 3 FSDP ranks, slices of both savers'), and
    # only files of the checkpoint.
    assert weights <= set(every) <= shards, (weights, every)
    saved = torch.load(f"{root}/{kind}-save-saving-node-rank0.pt")
    for rank in range(3) if kind == "ddp" else (0,):
        assert_equal_trees(saved, torch.load(f"{root}/{kind}-restore-fresh-node-rank{rank}.pt"))
    if kind == "ddp":  # restarted on the node that saved it: read from the node's copy, no download
        assert spawn(2, root, s3_server, kind, "restore", "saving-node") == [[], []]
        for rank in range(2):
            assert_equal_trees(saved, torch.load(f"{root}/{kind}-restore-saving-node-rank{rank}.pt"))
