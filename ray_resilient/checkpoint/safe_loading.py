"""Loading a checkpoint without running code from it.

DCP stores ``.metadata`` and every non-tensor value (RNG states, the data position, scheduler
and scaler states, extras) as pickles, and its reader unpickles them with ``pickle.load`` and
``torch.load(weights_only=False)``: whoever can write a checkpoint directory could run code in
every worker that restores it. Here ``.metadata`` is unpickled with only DCP's metadata classes,
``torch.Size``, dtypes, layouts and paths allowed, and every other value with
``torch.load(weights_only=True)`` (plus numpy's array reconstruction, for numpy's RNG state). A
checkpoint that needs anything else is refused as unreadable, naming the class.

User extras holding their own classes must allow them with
``torch.serialization.add_safe_globals``; a plain ``dict`` of numbers, strings and tensors needs
nothing.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from ray_resilient._torch_internals import METADATA_PRIVATE_GLOBALS, set_loaded_value
from ray_resilient.watchdog.progress import note_progress

# numpy's RNG state holds a uint32 array: what ``torch.load`` needs to rebuild one.
NUMPY_ARRAY_GLOBALS = [np.zeros(1).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}
_ALLOWED = {*METADATA_PRIVATE_GLOBALS, ("torch", "Size"), ("collections", "OrderedDict")}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file refers to code that loading it would run."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == pathlib.__name__ and name in _PATHS:
            return getattr(pathlib, name)
        raise UnsafeCheckpointError(
            f".metadata refers to {module}.{name}, which is not part of DCP's metadata: refusing to load it "
            "(a checkpoint's files are never allowed to run code)"
        )


def read_metadata(stream: BinaryIO) -> Metadata:
    """Unpickle a DCP ``.metadata`` file, allowing DCP's metadata classes only."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor values with ``torch.load(weights_only=True)``;
    each value loaded is progress for the hang watchdog (a long restore that reads on is no hang)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        with torch.serialization.safe_globals(NUMPY_ARRAY_GLOBALS):
            loaded = torch.load(value, weights_only=True)
        set_loaded_value(self, read_item, loaded)
        note_progress()

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        note_progress()
