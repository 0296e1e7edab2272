"""Staging: the copy the training loop pays for, into host buffers allocated once and reused.

Every tensor of the state dict is copied into a host buffer of its own (pinned when CUDA is in
use, so device-to-host copies are DMA transfers issued non-blocking), then one synchronize; the
buffers are kept for the next save, so after the first save staging allocates nothing. A
DTensor (FSDP2, tensor parallel) is staged as a DTensor with the same mesh and placements over a
host copy of its local shard: each rank stages only what it holds.

Not DCP's ``DefaultStager``: in torch 2.11 and 2.12 (2.11 is what current GPU images ship; 2.13
and 2.14 are fine) its ``stage()`` closes the inner ``StateDictStager`` after every call, which
empties its type dispatch table, so the second ``stage()`` on the same stager raises
``KeyError: <class 'type'>``, and its storage cache, so no buffer is ever reused (fresh pinned
memory every save). This stager behaves the same on every supported torch, and is the copy floor
the benchmarks measure against.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ray_resilient._torch_internals import with_local_tensor

Path = tuple[Any, ...]


class HostStager:
    """Copies state dicts into reused host buffers.

    Args:
        pin_memory: allocate pinned buffers and copy non-blocking; None (default): when the
            first state staged has CUDA tensors.
    """

    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = pin_memory
        self._leaves: dict[Path, tuple[torch.Tensor, torch.Tensor]] = {}  # path -> (buffer, staged leaf)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the buffers."""
        return sum(buffer.numel() * buffer.element_size() for buffer, _ in self._leaves.values())

    def stage(self, state_dict: Mapping[str, Any], progress: Callable[[], None] | None = None) -> dict[str, Any]:
        """A snapshot of ``state_dict``: tensors in this stager's buffers, other values deep-copied;
        ``progress`` is called after each tensor's copy.

        The snapshot stays valid until the next ``stage()``: the caller must not stage again
        while it is still being written.
        """
        if self.pin_memory is None:
            self.pin_memory = any(leaf.is_cuda for leaf in _tensor_leaves(state_dict))
        used: dict[Path, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            staged = self._stage(state_dict, (), used, progress or _nothing)
        self._leaves = used  # buffers of tensors that disappeared are released
        if self.pin_memory:
            torch.cuda.synchronize()
        return staged

    def close(self) -> None:
        self._leaves = {}

    def _stage(self, node: Any, path: Path, used: dict[Path, tuple[torch.Tensor, torch.Tensor]],
               progress: Callable[[], None]) -> Any:
        if isinstance(node, torch.Tensor):
            buffer, leaf = self._buffer_for(path, node)
            buffer.copy_(node.to_local() if isinstance(node, DTensor) else node, non_blocking=self.pin_memory)
            used[path] = (buffer, leaf)
            progress()
            return leaf
        if isinstance(node, Mapping):
            return {key: self._stage(value, (*path, key), used, progress) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            staged = [self._stage(value, (*path, i), used, progress) for i, value in enumerate(node)]
            if isinstance(node, list):
                return staged
            return type(node)(*staged) if hasattr(node, "_fields") else tuple(staged)  # a namedtuple, or a tuple
        return copy.deepcopy(node)

    def _buffer_for(self, path: Path, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (buffer, staged leaf) for ``path``, or new ones if the tensor changed."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        cached = self._leaves.get(path)
        if cached is not None and _same_layout(cached[1], tensor) and cached[0].shape == local.shape:
            return cached
        buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pin_memory)
        if not isinstance(tensor, DTensor):
            return buffer, buffer
        if tensor.device.type == "cpu":
            leaf = DTensor.from_local(buffer, tensor.device_mesh, tensor.placements, run_check=False,
                                      shape=tensor.shape, stride=tensor.stride())
        else:
            # from_local would move the buffer to the mesh's device: a host copy of the DTensor
            # (same mesh and placements) whose local shard is then swapped for the buffer.
            leaf = with_local_tensor(tensor.detach().to("cpu"), buffer)
        return leaf.to_local(), leaf


def _nothing() -> None:
    pass


def _tensor_leaves(node: Any) -> Iterator[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, Mapping):
        for value in node.values():
            yield from _tensor_leaves(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _tensor_leaves(value)


def _same_layout(leaf: torch.Tensor, tensor: torch.Tensor) -> bool:
    if isinstance(tensor, DTensor) != isinstance(leaf, DTensor) or leaf.dtype != tensor.dtype:
        return False
    if isinstance(tensor, DTensor):
        return (leaf.shape == tensor.shape and leaf.device_mesh == tensor.device_mesh
                and leaf.placements == tensor.placements)
    return leaf.shape == tensor.shape
