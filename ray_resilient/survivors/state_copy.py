"""A replica's state copied to the replicas behind it: tensor by tensor, nothing unpickled.

The source sends a *layout* first: the state's nested structure as JSON, each tensor in it a
(dtype, shape) placeholder and every other leaf a plain JSON value (ints, floats, strings, bools,
None; dict keys keep their type). Then it broadcasts each tensor in a group of the source (rank 0)
and the replicas behind it only (one already up to date receives nothing). A receiver takes each tensor straight into
its own tensor at the same place in its state when one matches (the model's parameters, the
optimizer's buffers once it stepped), else into a new one, so the copy holds at most one tensor's
worth of extra memory on either side (a CUDA tensor passes through host memory one at a time).
Nothing received is unpickled: a dtype outside torch's dtypes or a leaf JSON cannot hold is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

Wait = Callable[[Any], None]  # waits for a gloo Work (raising when a replica was lost)


class StateLayoutError(ValueError):
    """A state that cannot be copied, or a received layout that is not one."""


def _key(key: Any) -> list[Any]:
    if isinstance(key, (bool, int, float, str)) or key is None:
        return [type(key).__name__, key]
    raise StateLayoutError(f"a state dict key of type {type(key).__name__} cannot be copied: {key!r}")


_KEY_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "NoneType": type(None)}


def _unkey(encoded: list[Any]) -> Any:
    kind, value = encoded
    if kind not in _KEY_TYPES or type(value) is not _KEY_TYPES[kind]:
        raise StateLayoutError(f"bad key in a state layout: {encoded!r}")
    return value


def describe(state: Any, tensors: list[torch.Tensor], where: str = "state") -> Any:
    """The JSON-able layout of ``state``; its tensors are appended to ``tensors`` in layout order."""
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return {"tensor": [str(state.dtype).removeprefix("torch."), list(state.shape)]}
    if isinstance(state, dict):
        return {"dict": [[_key(k), describe(v, tensors, f"{where}[{k!r}]")] for k, v in state.items()]}
    if isinstance(state, (list, tuple)):
        items = [describe(v, tensors, f"{where}[{i}]") for i, v in enumerate(state)]
        return {"list" if isinstance(state, list) else "tuple": items}
    if state is None or isinstance(state, (bool, int, float, str)):
        return {"value": state}
    raise StateLayoutError(f"{where} is a {type(state).__name__}, which a replica's state copy cannot carry "
                           "(tensors, numbers, strings, None, and dicts, lists and tuples of them)")


def placeholders(layout: Any, own: Any, out: list[torch.Tensor]) -> None:
    """For each tensor of ``layout``, in order: the receiver's own tensor at the same place in
    ``own`` when its dtype and shape match, else a new empty one."""
    if not isinstance(layout, dict) or len(layout) != 1:
        raise StateLayoutError(f"bad node in a state layout: {str(layout)[:100]}")
    [(kind, body)] = layout.items()
    if kind == "tensor":
        name, shape = body
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise StateLayoutError(f"bad tensor in a state layout: {body!r}")
        if isinstance(own, torch.Tensor) and own.dtype == dtype and list(own.shape) == shape:
            out.append(own)
        else:
            out.append(torch.empty(shape, dtype=dtype))
    elif kind == "dict":
        own_items = own if isinstance(own, dict) else {}
        for key, child in body:
            placeholders(child, own_items.get(_unkey(key)), out)
    elif kind in ("list", "tuple"):
        own_items = own if isinstance(own, (list, tuple)) and len(own) == len(body) else [None] * len(body)
        for child, own_child in zip(body, own_items):
            placeholders(child, own_child, out)
    elif kind != "value":
        raise StateLayoutError(f"bad node kind in a state layout: {kind!r}")


def rebuild(layout: Any, tensors: list[torch.Tensor]) -> Any:
    """The state of ``layout`` with ``tensors`` (in layout order) in its tensors' places."""
    position = iter(tensors)

    def build(node: dict[str, Any]) -> Any:
        [(kind, body)] = node.items()
        if kind == "tensor":
            return next(position)
        if kind == "dict":
            return {_unkey(key): build(child) for key, child in body}
        if kind in ("list", "tuple"):
            items = [build(child) for child in body]
            return items if kind == "list" else tuple(items)
        return body

    return build(layout)


def send_state(group: Any, state: Any, wait: Wait, before_tensors: Callable[[], None] = lambda: None) -> int:
    """Broadcast ``state`` from rank 0 of ``group`` (the source and the replicas behind it);
    returns the bytes sent. ``before_tensors`` runs once the layout was sent (a fault point)."""
    tensors: list[torch.Tensor] = []
    layout = json.dumps(describe(state, tensors)).encode()
    header = torch.frombuffer(bytearray(layout), dtype=torch.uint8)
    wait(group.broadcast(torch.tensor([header.numel()], dtype=torch.int64), 0))
    wait(group.broadcast(header, 0))
    before_tensors()
    sent = header.numel()
    for tensor in tensors:
        wire = tensor.detach().to("cpu", copy=False).contiguous()
        wait(group.broadcast(wire, 0))
        sent += wire.numel() * wire.element_size()
    return sent


def receive_state(group: Any, own: Any, wait: Wait) -> Any:
    """Receive the state :func:`send_state` broadcasts, into ``own``'s tensors where they fit."""
    size = torch.zeros(1, dtype=torch.int64)
    wait(group.broadcast(size, 0))
    header = torch.empty(int(size), dtype=torch.uint8)
    wait(group.broadcast(header, 0))
    try:
        layout = json.loads(header.numpy().tobytes())
    except ValueError as err:
        raise StateLayoutError(f"a state layout that is not JSON: {err}") from err
    targets: list[torch.Tensor] = []
    placeholders(layout, own, targets)
    for target in targets:
        wire = target if target.device.type == "cpu" and target.is_contiguous() else torch.empty_like(
            target, device="cpu", memory_format=torch.contiguous_format)
        wait(group.broadcast(wire, 0))
        if wire is not target:
            with torch.no_grad():
                target.copy_(wire)
    return rebuild(layout, targets)
