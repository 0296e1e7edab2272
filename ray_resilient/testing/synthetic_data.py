"""Seeded in-memory classification data with an exact, resumable position (no files, no downloads).

The data of the DDP job (``jobs/train_ddp.py``), the chaos tests and the recovery benchmarks: a
run resumed from any checkpoint, on any number of workers, must see exactly the global batches of
an uninterrupted run, and here that is cheap to check.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

FEATURES = 32
CLASSES = 4


class SyntheticBatches:
    """Seeded in-memory classification data, served in global batches with an exact position.

    The order of each epoch is a pure function of (seed, epoch); rank r takes its slice of each
    global batch. The position (epoch, global batches consumed) is the same on every rank, so it
    also carries over to a different number of workers.
    """

    def __init__(self, samples: int, global_batch: int, seed: int, rank: int, world_size: int):
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by {world_size} workers")
        if samples < global_batch:
            raise ValueError(f"{samples} samples cannot fill one global batch of {global_batch}")
        gen = torch.Generator().manual_seed(seed)
        centers = torch.randn(CLASSES, FEATURES, generator=gen) * 0.4
        self.labels = torch.randint(0, CLASSES, (samples,), generator=gen)
        self.features = centers[self.labels] + torch.randn(samples, FEATURES, generator=gen)
        self.global_batch, self.seed, self.rank, self.world_size = global_batch, seed, rank, world_size
        self.batches_per_epoch = samples // global_batch  # the tail is dropped: equal batches per rank
        self.epoch, self.consumed = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.consumed = state["epoch"], state["consumed"]

    def load_resharded_state_dicts(self, states: list[dict[str, int]]) -> None:
        self.load_state_dict(states[0])  # the position is global: every rank saved the same

    def micro_batch(self, step: int, part: int, parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Part ``part`` of ``parts`` of global batch ``step`` (0-based, counted over epochs): the
        sample ids, features and labels, from the same plan the iterator serves."""
        if self.global_batch % parts:
            raise ValueError(f"global batch {self.global_batch} is not divisible into {parts} micro-batches")
        epoch, index = divmod(step, self.batches_per_epoch)
        size = self.global_batch // parts
        start = index * self.global_batch + part * size
        ids = self._order(epoch)[start:start + size]
        return ids, self.features[ids], self.labels[ids]

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's (sample ids, features, labels) of each remaining global batch of the epoch."""
        order = self._order(self.epoch)
        per_rank = self.global_batch // self.world_size
        while self.consumed < self.batches_per_epoch:
            start = self.consumed * self.global_batch + self.rank * per_rank
            ids = order[start:start + per_rank]
            self.consumed += 1
            yield ids, self.features[ids], self.labels[ids]
        self.epoch, self.consumed = self.epoch + 1, 0
