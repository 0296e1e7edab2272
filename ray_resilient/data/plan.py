"""The global sample plan: which sample every rank and DataLoader worker reads, as a pure function.

From (seed, epoch) one permutation of all samples. Global batch ``b`` of an epoch is the
permutation's slice ``[b * B, (b + 1) * B)``; rank ``r`` of ``W`` takes its contiguous
``B / W`` share of it. A rank's DataLoader consumes its workers' batches round-robin, so worker
``k`` of ``K`` serves the rank's batches ``start + k, start + k + K, ...``. Because the sequence of
global batches does not depend on ``W`` or ``K``, a position (epoch, global batches consumed)
continues the same global sequence on any number of ranks or workers with the same ``B``.

In survivor mode a global batch is cut into ``M`` micro-batches instead, micro-batch ``m`` its
contiguous slice ``[m * B / M, (m + 1) * B / M)``, and the replica of rank ``r`` among ``n`` live
ones reads micro-batches ``r, r + n, ...`` of each: which replica reads a micro-batch changes with
the membership, its samples never do.

Every rank gets the same number of batches per epoch by construction: the tail of the
permutation that does not fill a global batch is dropped (``drop_last=True``, the default), or
the last batch is padded by repeating the epoch's first samples (``drop_last=False``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers, e.g. (seed, epoch, sample index).

    SplitMix64's finalizer applied along the parts: order-sensitive, a few microseconds in pure
    Python (it runs once per sample; numpy's ``SeedSequence`` takes ten times as long).
    """
    state = _GOLDEN
    for part in parts:
        state = (state + (part & _MASK64) + _GOLDEN) & _MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    return state >> 1


@dataclass(frozen=True)
class SamplePlan:
    """The deterministic order of ``num_samples`` samples in global batches of ``global_batch``."""

    num_samples: int
    global_batch: int
    world_size: int
    seed: int = 0
    drop_last: bool = True
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.world_size < 1:
            raise ValueError(f"global_batch ({self.global_batch}) and world size ({self.world_size}) must be >= 1")
        if self.global_batch % self.world_size:
            raise ValueError(
                f"global batch size {self.global_batch} is not divisible by the world size {self.world_size}: "
                "every rank must take an equal share of each global batch"
            )
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"{self.num_samples} samples cannot fill one global batch of {self.global_batch} "
                f"({self.world_size} ranks x {self.global_batch // self.world_size} per rank): "
                "use more samples, a smaller global batch, or drop_last=False"
            )

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return -(-self.num_samples // self.global_batch)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of sample indices (padded to whole global batches if drop_last=False)."""
        if self.shuffle:
            order = np.random.default_rng(derive_seed(self.seed, epoch)).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        needed = self.batches_per_epoch * self.global_batch
        if needed > len(order):
            order = np.concatenate([order, order[: needed - len(order)]])
        return order[:needed]

    def global_batch_indices(self, epoch: int, batch: int) -> np.ndarray:
        order = self.permutation(epoch)
        return order[batch * self.global_batch:(batch + 1) * self.global_batch]

    def rank_batches(self, epoch: int, rank: int, start_batch: int = 0) -> list[np.ndarray]:
        """Rank ``rank``'s sample indices of each global batch from ``start_batch`` to the epoch's end."""
        order = self.permutation(epoch).reshape(self.batches_per_epoch, self.global_batch)
        share = order[start_batch:, rank * self.per_rank_batch:(rank + 1) * self.per_rank_batch]
        return list(share)

    def worker_batches(
        self, epoch: int, rank: int, worker: int, num_workers: int, start_batch: int = 0
    ) -> list[tuple[int, np.ndarray]]:
        """(global batch number, sample indices) that DataLoader worker ``worker`` serves, in order."""
        batches = self.rank_batches(epoch, rank, start_batch)
        return [(start_batch + i, b) for i, b in enumerate(batches) if i % max(num_workers, 1) == worker]

    def micro_batch_items(self, epoch: int, micro_batches: int, rank: int, members: int,
                          start_batch: int = 0) -> list[tuple[int, int, np.ndarray]]:
        """(global batch number, micro-batch, sample indices) of the micro-batches ``rank, rank +
        members, ...`` of ``micro_batches`` of each global batch from ``start_batch`` to the epoch's end."""
        self.check_micro_batches(micro_batches, rank, members)
        size = self.global_batch // micro_batches
        order = self.permutation(epoch).reshape(self.batches_per_epoch, self.global_batch)
        return [(batch, part, order[batch, part * size:(part + 1) * size])
                for batch in range(start_batch, self.batches_per_epoch) for part in range(rank, micro_batches, members)]

    def check_micro_batches(self, micro_batches: int, rank: int, members: int) -> None:
        """Fail clearly when replica ``rank`` of ``members`` cannot share ``micro_batches`` equal micro-batches."""
        if micro_batches < 1 or self.global_batch % micro_batches:
            raise ValueError(f"global batch size {self.global_batch} is not divisible into {micro_batches} "
                             "micro-batches: every micro-batch must have the same number of samples")
        if not 0 <= rank < members <= micro_batches:
            raise ValueError(f"replica {rank} of {members} cannot share {micro_batches} micro-batches: "
                             "each of 1 to micro_batches live replicas needs at least one")

    def check_workers(self, num_workers: int) -> None:
        """Fail clearly when a DataLoader worker would get no batch in an epoch."""
        if num_workers > self.batches_per_epoch:
            raise ValueError(
                f"{num_workers} DataLoader workers per rank but only {self.batches_per_epoch} batches per epoch "
                f"({self.num_samples} samples, global batch {self.global_batch}, world size {self.world_size}): "
                "some workers would get nothing; use fewer workers"
            )


def fingerprint(entries: list[tuple[str, int]]) -> str:
    """A short digest of a volume's listing (relative path, size): the plan is only valid for it."""
    digest = hashlib.sha256()
    for path, size in entries:
        digest.update(f"{path}\0{size}\n".encode())
    return digest.hexdigest()[:16]
