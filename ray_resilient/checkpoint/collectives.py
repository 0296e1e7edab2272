"""The collectives checkpointing needs, on its own gloo groups (no-ops without torch.distributed)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_ranks_agree(group: dist.ProcessGroup | None, ok: bool) -> bool:
    """True only if ``ok`` is true on every rank. Every rank must call it at the same point."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def smallest_on_any_rank(group: dist.ProcessGroup | None, value: int) -> int:
    """The minimum of ``value`` over every rank. Every rank must call it at the same point."""
    if group is None:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group)
    return int(box.item())


def broadcast_from_rank0(group: dist.ProcessGroup | None, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (picklable objects)."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def all_gathered(group: dist.ProcessGroup | None, value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    if group is None:
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def worst_on_any_rank(group: dist.ProcessGroup | None, outcome: tuple[int, str]) -> tuple[int, str]:
    """The ``(severity, message)`` of highest severity over every rank (picklable message)."""
    return max(all_gathered(group, outcome), key=lambda o: o[0])
