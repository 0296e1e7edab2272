"""FSDP2 (``fully_shard``) models through the checkpoint pieces: real processes on gloo, no Ray.

Each rank stages and writes only its own shards; a checkpoint written by N ranks restores on M,
and the model and optimizer come back bitwise (compared as full, unsharded state dicts).
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ray_resilient.checkpoint.layout import checkpoint_dir_name, list_checkpoints
from ray_resilient.checkpoint.restore import load_newest_loadable
from ray_resilient.checkpoint.state import TrainingComponents, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import AsyncCheckpointWriter
from ray_resilient.faults import FaultInjector

pytestmark = pytest.mark.slow  # process groups of spawned processes

FEATURES, HIDDEN, CLASSES = 64, 4097, 5  # 4097 rows: uneven shards on 2 and 3 ranks; 3.4 MB of state
# with Adam, so that the RNG state and the framing of DCP's files are small beside it


def sharded_model(seed: int) -> torch.nn.Module:
    """Sharded over a CPU mesh of the gloo ranks (``fully_shard``'s default mesh is on CUDA where a
    GPU exists, which these host-memory ranks do not use)."""
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optimizer": optim_sd}


def run_rank(rank: int, world: int, store_dir: str, root: str, phase: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", world), rank=rank, world_size=world)
    try:
        storage = CheckpointStorage(pafs.LocalFileSystem(), f"{root}/run", f"{root}/local")
        faults = FaultInjector([], rank, storage.filesystem, f"{root}/run/.faults")
        model = sharded_model(seed=0 if phase == "save" else 99)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        components = TrainingComponents(model, optimizer)
        writer = AsyncCheckpointWriter(storage, rank, faults)
        if phase == "save":
            torch.manual_seed(1 + rank)  # each rank its own batches, as with DDP
            for _ in range(3):
                loss = model(torch.randn(8, FEATURES)).logsumexp(1).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            writer.save(components.state_to_save(TrainState(step=3, world_size=world), rank), 3, checkpoint_dir_name(3, 0))
            assert writer.collect()[-1].ok
            full = full_state(model, optimizer)  # on rank 0 (cpu_offload)
            if rank == 0:
                torch.save(full, f"{root}/saved_full.pt")
            torch.save(writer.staged_bytes, f"{root}/staged-rank{rank}.pt")
        else:
            checkpoints = [c for c in reversed(list_checkpoints(storage.filesystem, storage.experiment_path))]
            loaded = load_newest_loadable(storage, checkpoints, components, rank, world, writer.group)
            assert loaded is not None and loaded[1].step == 3
            full = full_state(model, optimizer)
            if rank == 0:
                torch.save(full, f"{root}/restored_full-{world}.pt")
        writer.close()
    finally:
        dist.destroy_process_group()


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)


def spawn(world: int, root: str, phase: str) -> None:
    store_dir = f"{root}/store-{phase}-{world}"
    os.makedirs(store_dir)
    mp.spawn(run_rank, args=(world, store_dir, root, phase), nprocs=world, join=True)


def assert_equal_trees(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_equal_trees(a[key], b[key], f"{path}.{key}")
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("fsdp"))
    spawn(2, root, "save")
    return root


def test_each_rank_stages_and_writes_only_its_own_shards(saved_on_two_ranks):
    full = torch.load(f"{saved_on_two_ranks}/saved_full.pt")
    total = sum(t.numel() * t.element_size() for part in full.values() for t in _tensors(part))
    for rank in (0, 1):
        staged = torch.load(f"{saved_on_two_ranks}/staged-rank{rank}.pt")
        assert 0.4 * total < staged < 0.6 * total, (rank, staged, total)  # about half each (plus its RNG state)
    directory = f"{saved_on_two_ranks}/run/{checkpoint_dir_name(3, 0)}"
    written = {rank: sum(os.path.getsize(f"{directory}/{name}") for name in os.listdir(directory)
                         if name.startswith(f"__{rank}_") and name.endswith(".distcp")) for rank in (0, 1)}
    assert all(0.4 * total < size < 0.6 * total for size in written.values()), (written, total)


@pytest.mark.parametrize("restore_world", [1, 2, 3])
def test_an_fsdp2_checkpoint_restores_bitwise_on_any_number_of_ranks(saved_on_two_ranks, restore_world):
    spawn(restore_world, saved_on_two_ranks, "restore")
    saved = torch.load(f"{saved_on_two_ranks}/saved_full.pt")
    restored = torch.load(f"{saved_on_two_ranks}/restored_full-{restore_world}.pt")
    assert_equal_trees(saved, restored)
