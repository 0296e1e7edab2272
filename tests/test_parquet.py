"""Parquet files of samples: whole files sharded across ranks and workers, rows shuffled in a window."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchvision.io import encode_jpeg

from ray_resilient.data import PARQUET_STREAMING, ParquetVolumeDataset, Volume, VolumeDataLoader
from ray_resilient.testing.image_volume import make_image

ROWS = [9, 14, 11, 12, 10, 15, 13]  # 7 files, 84 rows


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(0)
    for i, rows in enumerate(ROWS):
        labels = rng.integers(0, 3, rows)
        images = [encode_jpeg(make_image(int(label), 16, rng)).numpy().tobytes() for label in labels]
        pq.write_table(pa.table({"image": images, "label": labels}), root / f"part-{i:03d}.parquet")
    return str(root)


def loaders(parquet_dir, cache, world: int, workers: int) -> list[VolumeDataLoader]:
    volume = Volume(parquet_dir, extensions=(".parquet",), image_folder=False)
    streaming = dataclasses.replace(PARQUET_STREAMING, cache_dir=str(cache))
    return [VolumeDataLoader(ParquetVolumeDataset(volume, global_batch=4, rank=r, world_size=world,
                                                  num_workers=workers, seed=2, shuffle_window=6, streaming=streaming),
                             num_workers=workers) for r in range(world)]


def file_of(row: int) -> int:
    return int(np.searchsorted(np.cumsum(ROWS), row, side="right"))


def test_files_are_sharded_and_every_rank_gets_equal_batches(parquet_dir, tmp_path):
    ranks = loaders(parquet_dir, tmp_path / "cache", world=2, workers=2)
    for _epoch in range(2):
        per_rank = [list(loader) for loader in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) > 0
        rows = [i for batches in per_rank for b in batches for i in b.sample_ids.tolist()]
        assert len(rows) == len(set(rows))  # no row twice in an epoch
        # Each (rank, worker) slot reads whole files that no other slot touches.
        files_by_slot = {}
        for rank, batches in enumerate(per_rank):
            for b in batches:
                slot = (rank, b.global_batch % 2)
                files_by_slot.setdefault(slot, set()).update(file_of(i) for i in b.sample_ids.tolist())
        slots = list(files_by_slot.values())
        assert all(a.isdisjoint(b) for i, a in enumerate(slots) for b in slots[i + 1:])
    assert all(loader.epoch == 2 and loader.batch == 0 for loader in ranks)


def test_parquet_position_resumes_exactly_on_the_same_layout(parquet_dir, tmp_path):
    full = [b.sample_ids.tolist() for b in loaders(parquet_dir, tmp_path / "c1", 1, 2)[0]]
    first = loaders(parquet_dir, tmp_path / "c2", 1, 2)[0]
    head = []
    for batch in first:
        head.append(batch.sample_ids.tolist())
        if len(head) == 3:
            break
    resumed = loaders(parquet_dir, tmp_path / "c2", 1, 2)[0]
    resumed.load_state_dict(first.state_dict())
    assert head + [b.sample_ids.tolist() for b in resumed] == full
    images = [b.images for b in loaders(parquet_dir, tmp_path / "c3", 1, 2)[0]]
    again = [b.images for b in loaders(parquet_dir, tmp_path / "c4", 1, 2)[0]]
    assert all(torch.equal(a, b) for a, b in zip(images, again))


def test_parquet_position_on_another_layout_restarts_the_epoch_with_a_warning(parquet_dir, tmp_path, caplog):
    first = loaders(parquet_dir, tmp_path / "c", 2, 1)[0]
    next(iter(first))
    other = loaders(parquet_dir, tmp_path / "c", 1, 1)[0]
    with caplog.at_level(logging.WARNING):
        other.load_state_dict(first.state_dict())
    assert "restarts from its beginning" in caplog.text
    assert (other.epoch, other.batch) == (0, 0)


def test_too_few_files_for_the_slots_is_refused(parquet_dir, tmp_path):
    with pytest.raises(ValueError, match="7 Parquet files cannot feed 8"):
        loaders(parquet_dir, tmp_path / "c", world=4, workers=2)
