"""One test per private torch API in ``ray_resilient._torch_internals``: each fails when a torch
version changes what the wall relies on (scripts/test.sh runs them on the lowest supported torch too)."""

from __future__ import annotations

import datetime
import importlib
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter

from ray_resilient import _torch_internals

STATE = {"model": {"layer": {"weight": torch.arange(6.0).reshape(2, 3)}},
         "optimizer": {"state": {"0": {"step": 3, "momentum": torch.ones(2)}}, "groups": [{"lr": 0.1}]},
         "position": {"epoch": 2, "batches": [4, 5]}}


def saved(tmp_path: Path, state: dict = STATE, **kwargs) -> Path:
    path = tmp_path / "checkpoint"
    dcp.save(state, checkpoint_id=str(path), **kwargs)
    return path


def empty_like(state: dict) -> dict:
    """``state``'s structure with zeroed tensors and placeholders for the other values."""
    if isinstance(state, dict):
        return {key: empty_like(value) for key, value in state.items()}
    if isinstance(state, list):
        return [empty_like(value) for value in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


class Box:
    """A ``Stateful`` value: what DCP loads for a top-level key reaches the caller only through one."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


def test_dcp_saves_a_nested_state_under_the_flattened_keys(tmp_path):
    """restore's compatibility check compares the job's state with ``.metadata`` key by key."""
    metadata = FileSystemReader(str(saved(tmp_path))).read_metadata()
    assert set(_torch_internals.flatten_like_dcp(STATE)) == set(metadata.state_dict_metadata)


@pytest.mark.parametrize("flatten", [True, False])
def test_a_loaded_value_is_put_where_the_default_planner_puts_it(tmp_path, flatten):
    """safe_loading's planner unpickles non-tensor values itself, then places them as DCP does."""
    path = saved(tmp_path, planner=DefaultSavePlanner(flatten_state_dict=flatten))

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            _torch_internals.set_loaded_value(self, read_item, torch.load(value, weights_only=True))

    placed = []  # flattened: into the nested state; not (whole top-level values): into the planner's state_dict
    for planner in (Planner(flatten_state_dict=flatten), DefaultLoadPlanner(flatten_state_dict=flatten)):
        state = {key: Box(value) for key, value in empty_like(STATE).items()}
        dcp.load(state, checkpoint_id=str(path), planner=planner)
        placed.append({key: box.value for key, box in state.items()} if flatten else planner.state_dict)
    ours, theirs = placed
    assert ours["position"] == theirs["position"] == STATE["position"]
    assert ours["optimizer"]["state"]["0"]["step"] == 3 and ours["optimizer"]["groups"] == [{"lr": 0.1}]
    assert torch.equal(ours["model"]["layer"]["weight"], STATE["model"]["layer"]["weight"])


def test_metadata_pickles_refer_to_exactly_the_private_globals_allowed(tmp_path):
    """safe_loading unpickles ``.metadata`` with an allowlist: a private class torch starts or stops
    pickling there must show up here, not as a checkpoint refused at restore."""
    found = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    with open(saved(tmp_path) / ".metadata", "rb") as stream:
        Recording(stream).load()
    private = {(module, name) for module, name in found if name.startswith("_") or "._" in f".{module}"}
    private -= {(module, name) for module, name in private if module == dcp.metadata.__name__}  # allowed by module
    assert private == _torch_internals.METADATA_PRIVATE_GLOBALS
    for module, name in private:
        assert hasattr(importlib.import_module(module), name)


class RecordingFileSystem(FileSystem):
    """DCP's local filesystem, remembering each file it opened."""

    def __init__(self):
        super().__init__()
        self.opened: list[str] = []

    def create_stream(self, path, mode):
        self.opened.append(Path(path).name)
        return super().create_stream(path, mode)


def test_a_file_system_reader_reads_through_its_fs_from_its_path(tmp_path):
    """ArrowDCPReader reads any pyarrow filesystem by giving DCP's reader another ``fs`` and ``path``."""
    path = saved(tmp_path)
    reader, fs = FileSystemReader(str(tmp_path / "elsewhere")), RecordingFileSystem()
    _torch_internals.redirect_reader(reader, fs, str(path))
    state = empty_like(STATE)
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["model"]["layer"]["weight"], STATE["model"]["layer"]["weight"])
    assert ".metadata" in fs.opened and any(name.endswith(".distcp") for name in fs.opened)


def test_the_readers_metadata_is_read_as_its_own_read_metadata_reads_it(tmp_path):
    reader = FileSystemReader(str(saved(tmp_path)))
    ours = _torch_internals.read_reader_metadata(reader, None, pickle.load)
    assert ours.state_dict_metadata == reader.read_metadata().state_dict_metadata
    assert ours.storage_meta.load_id == reader.load_id


def test_each_write_result_names_the_file_written(tmp_path):
    """The writer records a checksum per shard file it wrote."""
    names = []

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            names.extend(_torch_internals.written_file(result) for result in written.wait())
            return written

    path = tmp_path / "checkpoint"
    saved(tmp_path, storage_writer=Writer(str(path)))
    assert names and {name for name in names} <= {file.name for file in path.iterdir()}


def test_a_dtensors_local_shard_can_be_swapped_for_a_host_buffer(tmp_path):
    """Staging keeps a DTensor's host copy whose local shard is a reused (pinned) buffer."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        live = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
        buffer = torch.empty(4)
        staged = _torch_internals.with_local_tensor(live.detach().to("cpu"), buffer)
        staged.to_local().copy_(live.to_local())
        assert staged.to_local().data_ptr() == buffer.data_ptr()
        assert torch.equal(staged.full_tensor(), live.full_tensor()) and staged.placements == live.placements
    finally:
        dist.destroy_process_group()


def test_a_compiled_modules_keys_are_its_modules_behind_the_prefix():
    model = torch.nn.Linear(2, 2)
    keys = list(torch.compile(model).state_dict())
    assert all(key.startswith(_torch_internals.COMPILED_PREFIX) for key in keys)
    assert [_torch_internals.without_compile_prefix(key) for key in keys] == list(model.state_dict())


def test_a_gloo_group_takes_its_timeout_and_device_from_private_options():
    timeout = datetime.timedelta(seconds=7)
    group = _torch_internals.gloo_group(dist.HashStore(), 0, 1, timeout, "127.0.0.1")
    tensor = torch.ones(3)
    group.allreduce([tensor]).wait()
    assert torch.equal(tensor, torch.ones(3)) and group.options._timeout == timeout


def test_each_compilation_is_announced_before_its_backend_runs_and_after_it_ends():
    events = []

    def backend(graph, inputs):
        events.append("backend")
        return graph.forward

    stop = _torch_internals.on_compilations(lambda: events.append("started"), lambda: events.append("ended"))
    compiled = torch.compile(torch.nn.Linear(2, 2), backend=backend)
    compiled(torch.zeros(1, 2))
    compiled(torch.zeros(3, 2, 2))
    stop()
    assert events[:3] == ["started", "backend", "ended"]
    assert "".join(e[0] for e in events).replace("sbe", "") == ""  # every compilation announced around it
    announced = len(events)
    torch.compile(lambda x: x + 1, backend=backend)(torch.zeros(2))  # stopped: compiled, not announced
    assert events[announced:] == ["backend"]
