"""The step's exchange: the sum of every micro-batch's row, the same bits whoever computed which.

Each replica fills one row per micro-batch it computed (micro-batch ``k`` is computed by the
member of rank ``k % members``, in its slot ``k // members``); a row ends with every member's
controls, zero but in the member's own first row. The rows are cut into one contiguous
shard per member. A reduce-scatter made of an all-to-all gives each member its shard of every
row; it adds them in micro-batch order (``((row 0 + row 1) + row 2) + ...``, the order fixed by
the micro-batch index alone, so its bits do not depend on the membership) and divides the data
by the number of micro-batches; elements marked exact take micro-batch 0's value instead
(integer buffers such as BatchNorm's ``num_batches_tracked``), and the controls come out as
their one member sent them. An all-gather of the reduced shards then gives every member the
whole result.

The rows are the gradients' dtype, whatever the default one. The controls are integers (the
offered step, which outgrows a float's exact integers: 2**24 in float32, 256 in bfloat16): each
travels as :data:`DIGITS` base-256 digits, integers that a gradient's float dtype holds exactly
(bfloat16 has 8 significant bits), and adding zeros to them is exact.

Traffic per member and step, with ``n`` members and ``slots = ceil(micro_batches / n)``: it sends
``slots x (n - 1) / n`` rows in the all-to-all and ``(n - 1) / n`` of a row in the all-gather
(gloo's ring). With one micro-batch per member that is ``2 (n - 1) / n`` rows: what DDP's ring
all-reduce moves, at any ``n``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

CONTROLS = 2  # integers each member sends with its rows, which every member receives (survivor mode's flags)
DIGIT_BITS = 8  # a control's digits: integers below 2**8, exact in bfloat16 and every wider float dtype
DIGITS = 64 // DIGIT_BITS  # digits per control: an int64's bits
_SHIFTS = torch.arange(DIGITS, dtype=torch.int64) * DIGIT_BITS


class MicroBatchExchange:
    """Sums rows of ``row_length`` elements of ``dtype`` over ``micro_batches`` micro-batches among
    the members of a membership of at most ``replicas``.

    ``exact``: a boolean mask over a row, True where the result is micro-batch 0's value rather
    than the mean. Each row carries, after its data, every member's controls (zero but in the
    member's own first row), which the sum delivers unchanged. Every member computes at least one
    micro-batch and sends its controls in its first row, so ``micro_batches`` must be at least
    ``replicas`` (ValueError). Buffers are allocated once per membership size and reused: with one
    row per member, its rows are what it sends.
    """

    def __init__(self, row_length: int, micro_batches: int, exact: torch.Tensor, *, replicas: int,
                 dtype: torch.dtype):
        if micro_batches < replicas:
            raise ValueError(f"micro_batches ({micro_batches}) must be at least the replicas ({replicas}): "
                             "each replica computes at least one micro-batch of every global batch")
        self.row_length, self.micro_batches, self.dtype = row_length, micro_batches, dtype
        self._exact = exact
        self._size = 0
        self.sent_bytes = 0  # sent by this member in every exchange so far (the data, not gloo's framing)

    def rows(self, size: int) -> torch.Tensor:
        """This member's ``(slots, row_length)`` rows for a membership of ``size``, slot ``s`` for
        its micro-batch ``rank + s x size``: the caller writes every element of those it computes."""
        if size != self._size:
            self._size, self._slots = size, -(-self.micro_batches // size)
            length = self.row_length + self.micro_batches * CONTROLS * DIGITS
            self._shard = -(-length // size)  # every member's shard of a row, the last one padded
            self._rows = torch.zeros(self._slots, size * self._shard, dtype=self.dtype)
            self._send = torch.empty(self._rows.numel(), dtype=self.dtype) if self._slots > 1 else self._rows.view(-1)
            self._received = torch.empty(size, self._slots, self._shard, dtype=self.dtype)
            self._chunk = torch.empty(self._shard, dtype=self.dtype)
            self._reduced = torch.empty(size * self._shard, dtype=self.dtype)
            self._exact_at: dict[int, torch.Tensor] = {}  # rank -> the exact elements' indices in its shard
        return self._rows[:, :self.row_length]

    def reduce(self, group: Any, rank: int, controls: torch.Tensor,
               wait: Callable[[Any], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean of the membership's rows in micro-batch order (exact elements: micro-batch 0's),
        and every member's ``controls`` (``CONTROLS`` int64 each: ``(size, CONTROLS)``), from this
        member of rank ``rank`` in ``group`` whose rows :meth:`rows` gave. ``wait(work)`` waits for
        a collective (raising when a member is lost). The mean is this exchange's buffer,
        overwritten by the next."""
        size, slots, shard, data = self._size, self._slots, self._shard, self.row_length
        width = CONTROLS * DIGITS  # a member's controls in a row
        self._rows[:, data:data + self.micro_batches * width] = 0.0
        self._rows[0, data + rank * width:data + (rank + 1) * width] = ((controls[:, None] >> _SHIFTS) & 0xFF).view(-1)
        if slots > 1:  # the send buffer in destination order: shard j of each slot, for member j
            self._send.view(size, slots, shard).copy_(self._rows.view(slots, size, shard).transpose(0, 1))
        wait(group.alltoall_base(self._received.view(-1), self._send, [slots * shard] * size, [slots * shard] * size))

        def row(k: int) -> torch.Tensor:  # micro-batch k's part of this member's shard
            return self._received[k % size, k // size]

        total = self._chunk
        if self.micro_batches == 1:
            total.copy_(row(0))
        else:
            torch.add(row(0), row(1), out=total)
        for k in range(2, self.micro_batches):
            total += row(k)
        first = rank * shard  # this shard's first element in the row
        total[:max(0, min(shard, data - first))] /= self.micro_batches  # the data's mean; the controls as sent
        if rank not in self._exact_at:
            self._exact_at[rank] = self._exact[first:first + shard].nonzero().flatten()
        exact = self._exact_at[rank]
        total[exact] = row(0)[exact]
        wait(group.allgather([list(self._reduced.view(size, shard).unbind(0))], [total]))
        self.sent_bytes += total.element_size() * (size - 1) * (slots + 1) * shard
        digits = self._reduced[data:data + size * width].view(size, CONTROLS, DIGITS).to(torch.int64)
        return self._reduced[:data], (digits << _SHIFTS).sum(-1)
