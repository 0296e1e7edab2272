"""The volume dataset inside real Ray Train runs: a SIGKILLed worker resumes at the exact sample."""

from __future__ import annotations

import pytest

import pyarrow.fs as pafs

import trainlib
from ray_resilient.goodput import account, read_events

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def run(image_dir, tmp_path, faults: str):
    record = tmp_path / "rec"
    record.mkdir(parents=True)
    config = {"volume": image_dir, "cache_dir": str(tmp_path / "cache"), "global_batch": 6, "seed": 4, "epochs": 2,
              "interval": 5, "workers": 1, "record_dir": str(record), "faults": faults}
    result = trainlib.run_job(trainlib.image_train_fn, config, str(tmp_path / "storage"), "images")
    assert result.error is None
    return record


def test_killed_worker_resumes_with_exactly_the_samples_of_an_uninterrupted_run(image_dir, tmp_path):
    reference = run(image_dir, tmp_path / "reference", "")
    # Rank 1 dies once checkpoint 10 is durable, mid-epoch (a kill at a fixed step could come before
    # any save finished: under load the first one took more than 13 steps).
    killed = run(image_dir, tmp_path / "killed", "kill:durable=10:rank=1")
    assert [a["restored_step"] for a in trainlib.read_attempts(str(killed))] == [0, 10]
    for rank in (0, 1):
        expected = trainlib.consumed_samples(str(reference), rank)
        assert len(expected) == 22  # 2 epochs x 11 global batches
        assert trainlib.consumed_samples(str(killed), rank) == expected
    trainlib.assert_same_weights(trainlib.final_weights(killed), trainlib.final_weights(reference))
    # The loader's fetch_seconds reached the goodput ledger as the steps' data wait.
    breakdown = account(read_events(pafs.LocalFileSystem(), str(tmp_path / "killed" / "storage" / "images")))
    assert breakdown.data_wait > 0 and breakdown.steps_kept == 22
