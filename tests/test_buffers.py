"""Model buffers (BatchNorm running statistics) are per-rank state: real processes on gloo, no Ray.

Each rank updates its running statistics from its own batches, under DDP and FSDP2 alike. A
checkpoint must give every rank back its own (same world size), hold rank 0's under ``model``
(what plain DCP and an export read), and give rank 0's to every rank after a resize.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from ray_resilient.checkpoint.layout import checkpoint_dir_name, list_checkpoints
from ray_resilient.checkpoint.restore import load_newest_loadable
from ray_resilient.checkpoint.state import TrainingComponents, TrainState, model_buffers
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import AsyncCheckpointWriter
from ray_resilient.faults import FaultInjector

FEATURES = 8


def build(parallelism: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    if parallelism == "ddp":
        return DistributedDataParallel(model)
    fully_shard(model[0])
    return fully_shard(model)


def run_rank(rank: int, world: int, root: str, parallelism: str, phase: str) -> None:
    store = dist.FileStore(f"{root}/store-{phase}-{world}", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        storage = CheckpointStorage(pafs.LocalFileSystem(), f"{root}/run", f"{root}/local-{rank}")
        faults = FaultInjector([], rank, storage.filesystem, f"{root}/run/.faults")
        model = build(parallelism, seed=0 if phase == "save" else 99)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        components = TrainingComponents(model, optimizer)
        writer = AsyncCheckpointWriter(storage, rank, faults)
        if phase == "save":
            torch.manual_seed(1 + rank)  # each rank its own batches
            for _ in range(3):
                model(torch.randn(16, FEATURES) * (1 + rank)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            writer.save(components.state_to_save(TrainState(step=3, world_size=world), rank), 3,
                        checkpoint_dir_name(3, 0))
            assert writer.collect()[-1].ok
        else:
            checkpoints = list(reversed(list_checkpoints(storage.filesystem, storage.experiment_path)))
            assert load_newest_loadable(storage, checkpoints, components, rank, world, writer.group) is not None
        buffers = {key: value.clone() for key, value in model_buffers(model).items()}
        torch.save(buffers, f"{root}/{phase}-{world}-rank{rank}.pt")
        writer.close()
    finally:
        dist.destroy_process_group()


def spawn(world: int, root: str, parallelism: str, phase: str) -> None:
    mp.spawn(run_rank, args=(world, root, parallelism, phase), nprocs=world, join=True)


def load(root, name: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(root, name))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_each_rank_gets_its_own_buffers_back_and_the_model_entry_holds_rank_0s(tmp_path, parallelism):
    spawn(2, str(tmp_path), parallelism, "save")
    saved = [load(tmp_path, f"save-2-rank{rank}.pt") for rank in (0, 1)]
    assert set(saved[0]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert not torch.equal(saved[0]["1.running_mean"], saved[1]["1.running_mean"])  # the ranks differ

    spawn(2, str(tmp_path), parallelism, "restore")
    for rank in (0, 1):
        assert_same(load(tmp_path, f"restore-2-rank{rank}.pt"), saved[rank])

    spawn(1, str(tmp_path), parallelism, "restore")  # a resize: every rank takes rank 0's
    assert_same(load(tmp_path, "restore-1-rank0.pt"), saved[0])

    plain = {"model": {key: torch.empty_like(value) for key, value in saved[0].items()}}
    dcp.load(plain, checkpoint_id=str(tmp_path / "run" / checkpoint_dir_name(3, 0)))
    assert_same(plain["model"], saved[0])
