"""The volume dataset inside real Ray Train runs: a SIGKILLed worker resumes at the exact sample."""

from __future__ import annotations

import pytest

import trainlib
from test_checkpoint_ray import assert_same_weights, final_weights

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
    killed = run(image_dir, tmp_path / "killed", "kill:step=13:rank=1")
    assert [a["restored_step"] for a in trainlib.read_attempts(str(killed))] in ([0, 5], [0, 10])
    for rank in (0, 1):
        expected = trainlib.consumed_samples(str(reference), rank)
        assert len(expected) == 22  # 2 epochs x 11 global batches
        assert trainlib.consumed_samples(str(killed), rank) == expected
    assert_same_weights(final_weights(killed), final_weights(reference))
