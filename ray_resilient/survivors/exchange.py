"""The step's exchange: the sum of every micro-batch's row, the same bits whoever computed which.

Each replica fills one row per micro-batch it computed (micro-batch ``k`` is computed by the
member of rank ``k % members``, in its slot ``k // members``). The rows are cut into one
contiguous shard per member. A reduce-scatter made of an all-to-all gives each member its shard
of every row; it adds them in micro-batch order (``((row 0 + row 1) + row 2) + ...``, the order
fixed by the micro-batch index alone, so its bits do not depend on the membership) and divides by
the number of micro-batches; elements marked exact take micro-batch 0's value instead (integer
buffers such as BatchNorm's ``num_batches_tracked``). An all-gather of the reduced shards then
gives every member the whole result, with each member's control values beside its shard.

Traffic per member and step, with ``n`` members and ``slots = ceil(micro_batches / n)``: it sends
``slots x (n - 1) / n`` rows in the all-to-all and ``(n - 1) / n`` of a row in the all-gather
(gloo's ring). With one micro-batch per member that is ``2 (n - 1) / n`` rows: what DDP's ring
all-reduce moves, at any ``n``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

CONTROLS = 2  # values each member sends beside its reduced shard (survivor mode's flags)


class MicroBatchExchange:
    """Sums rows of ``row_length`` over ``micro_batches`` micro-batches among a membership's members.

    ``exact``: a boolean mask over a row, True where the result is micro-batch 0's value rather
    than the mean. Buffers are allocated once per membership size and reused.
    """

    def __init__(self, row_length: int, micro_batches: int, exact: torch.Tensor):
        self.row_length, self.micro_batches = row_length, micro_batches
        self._exact = exact
        self._size = 0
        self.sent_bytes = 0  # sent by this member in every exchange so far (the data, not gloo's framing)

    def rows(self, size: int) -> torch.Tensor:
        """The zeroed ``(slots, row_length)`` rows of this member, for a membership of ``size``."""
        if size != self._size:
            self._size = size
            self._slots = -(-self.micro_batches // size)
            self._bounds = [j * self.row_length // size for j in range(size + 1)]
            self._shard = -(-self.row_length // size)  # the all-gather's chunk: the longest shard
            self._rows = torch.zeros(self._slots, self.row_length)
            self._send = torch.empty(self._slots * self.row_length)
            self._gathered = torch.empty(size, self._shard + CONTROLS)
            self._reduced = torch.empty(self.row_length)
        else:
            self._rows.zero_()
        return self._rows

    def reduce(self, group: Any, rank: int, controls: torch.Tensor,
               wait: Callable[[Any], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean of the membership's rows in micro-batch order (exact elements: micro-batch 0's),
        and every member's ``controls`` (``(size, CONTROLS)``), from this member of rank ``rank``
        in ``group`` whose rows :meth:`rows` gave. ``wait(work)`` waits for a collective (raising
        when a member is lost). The result is this exchange's buffer, overwritten by the next."""
        size, slots, bounds = self._size, self._slots, self._bounds
        lengths = [bounds[j + 1] - bounds[j] for j in range(size)]
        offset = 0
        for j in range(size):  # destination j: its shard of each of this member's slots
            block = self._send[offset:offset + slots * lengths[j]].view(slots, lengths[j])
            block.copy_(self._rows[:, bounds[j]:bounds[j + 1]])
            offset += slots * lengths[j]
        mine = lengths[rank]
        received = torch.empty(size * slots * mine)
        wait(group.alltoall_base(received, self._send, [slots * mine] * size, [slots * n for n in lengths]))
        parts = received.view(size, slots, mine)

        def row(k: int) -> torch.Tensor:  # micro-batch k's part of this shard
            return parts[k % size, k // size]

        chunk = self._gathered[rank]
        total = chunk[:mine]
        total.copy_(row(0))
        for k in range(1, self.micro_batches):
            total += row(k)
        total /= self.micro_batches
        exact = self._exact[bounds[rank]:bounds[rank + 1]]
        total[exact] = row(0)[exact]
        chunk[self._shard:] = controls
        outputs = list(self._gathered.unbind(0))
        wait(group.allgather([outputs], [chunk.clone()]))
        for j in range(size):
            self._reduced[bounds[j]:bounds[j + 1]] = self._gathered[j, :lengths[j]]
        itemsize = self._send.element_size()
        self.sent_bytes += itemsize * (slots * (self.row_length - mine) + (size - 1) * (self._shard + CONTROLS))
        return self._reduced, self._gathered[:, self._shard:]
