"""Every use of a private PyTorch API, behind one wall.

ray_resilient needs a few things torch (2.11 to 2.14) offers only privately: DCP's flattening of
a nested state dict into the keys ``.metadata`` records, and its setter of a value at such a key
(restore, loading without running code); the private classes a ``.metadata`` pickle refers to;
the parts of DCP's ``FileSystemReader`` a reader on another filesystem replaces, and the file
name of a written shard (``_StorageInfo``); a DTensor's local shard (staging); the prefix
``torch.compile`` puts on a model's keys; gloo's group options (survivor mode's groups); dynamo's
callbacks around each compilation (the hang watchdog's allowance for a compile). Nothing
else in the repository imports a private torch module or touches a private torch name
(``tests/test_layering.py``).

Each use has a test in ``tests/test_torch_internals.py``, run on the newest and on the lowest
supported torch, that fails when a torch version changes it. None has a fallback: a changed one
fails the test suite before it reaches a run.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

# The private globals a DCP ``.metadata`` pickle refers to: each shard's file and byte range, and a
# tensor's layout (``torch.strided``) by name.
METADATA_PRIVATE_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
})
COMPILED_PREFIX = "_orig_mod."  # what a torch.compile'd module's state dict puts before its module's keys


def flatten_like_dcp(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` flattened to the keys DCP saves its values under (``optimizer.state.0.exp_avg``)."""
    flat, _ = flatten_state_dict(dict(state))
    return flat


def set_loaded_value(planner: DefaultLoadPlanner, read_item: ReadItem, value: Any) -> None:
    """Put a value the planner loaded where ``DefaultLoadPlanner.load_bytes`` puts one it unpickled:
    back into the nested state dict when the planner flattened it, else at its flat key."""
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], value)
    else:
        planner.state_dict[read_item.dest_index.fqn] = value


def read_reader_metadata(reader: FileSystemReader, rank: int | None,
                         unpickle: Callable[[BinaryIO], Metadata]) -> Metadata:
    """What ``FileSystemReader.read_metadata`` does, with ``unpickle`` in place of ``pickle.load``:
    the reader's (private) metadata path, and its load id stamped on the result."""
    with reader.fs.create_stream(reader._get_metadata_path(rank), "rb") as stream:
        metadata = unpickle(stream)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


def redirect_reader(reader: FileSystemReader, fs: FileSystemBase, path: str) -> None:
    """Make ``reader`` read the checkpoint at ``path`` through ``fs``: ``FileSystemReader`` takes no
    filesystem, but opens every file through its ``fs`` attribute, relative to its ``path``."""
    reader.fs = fs
    reader.path = path


def written_file(result: WriteResult) -> str:
    """The file, relative to the checkpoint directory, that ``FileSystemWriter`` wrote a result to."""
    return result.storage_data.relative_path


def with_local_tensor(dtensor: DTensor, local: torch.Tensor) -> DTensor:
    """``dtensor`` with its local shard replaced by ``local`` in place (same shape and dtype), as
    torch.distributed's own ``_create_cpu_state_dict`` does: ``DTensor.from_local`` would move
    ``local`` to the mesh's device."""
    dtensor._local_tensor = local
    return dtensor


def without_compile_prefix(key: str) -> str:
    """A state-dict key of a ``torch.compile``'d module as the module itself names it."""
    return key.replace(COMPILED_PREFIX, "")


def gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
               hostname: str) -> dist.ProcessGroupGloo:
    """A gloo group outside torch.distributed's default group, with its collectives' timeout and
    its device on ``hostname``'s interface: its constructor takes them only in private options."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def on_compilations(started: Callable[[], None], ended: Callable[[], None]) -> Callable[[], None]:
    """Call ``started`` when a ``torch.compile`` compilation begins in this process and ``ended``
    when it ends (dynamo's callbacks: once around nested compilations); a function that stops it."""
    from torch._dynamo.callback import callback_handler  # imported here: importing dynamo takes a while

    def start(*_: Any) -> None:
        started()

    def end(*_: Any) -> None:
        ended()

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)

    def stop() -> None:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)

    return stop
