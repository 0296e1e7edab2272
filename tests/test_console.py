"""What the driver's console shows of a run (the README's first command checks it end to end)."""

from __future__ import annotations

import traceback

from ray_resilient.console import FAILURE_MARK, describe_failure, shown_lines


def test_the_console_shows_the_workers_and_the_failure_block_not_rays_bookkeeping():
    worker = {"pid": 7, "actor_name": "RayTrainWorker", "lines": ["step 5/90", "Checkpoint ... durable",
                                                                   "Reporting training result 1: TrainingReport(...)"]}
    controller = {"pid": 8, "actor_name": "TrainController",
                  "lines": ["[FailurePolicy] RETRY", f"{FAILURE_MARK} attempt failed", "Traceback (most recent..."]}
    assert shown_lines(worker) == worker["lines"][:2]
    assert shown_lines(controller) == [f"{FAILURE_MARK} attempt failed"]
    assert shown_lines({"pid": "raylet", "lines": ["A worker died or was killed"]}) == []
    assert shown_lines({"pid": 9, "actor_name": "PlacementGroupCleaner", "lines": ["Traceback"]}) == []
    assert shown_lines({"pid": 10, "actor_name": "HangWatchdog", "lines": ["declared hung"]}) == ["declared hung"]


def test_a_failure_is_one_line_naming_the_error_never_its_traceback():
    try:
        raise OSError("injected storage write failure (fail_write-upload-10-rank0)")
    except OSError as err:
        with_traceback = RuntimeError("".join(traceback.format_exception(err)))
    assert describe_failure(with_traceback) == ": OSError: injected storage write failure (fail_write-upload-10-rank0)"
    assert describe_failure(ValueError("bad\nmore")) == ": ValueError: bad"
    health = RuntimeError("A worker health check failed.\nWorker(hostname='node-3', pid=4242, ...)\n"
                          "The actor died unexpectedly before finishing this task. Worker exit type: SYSTEM_ERROR")
    assert describe_failure(health) == " (host node-3, pid 4242): its process died (exit type SYSTEM_ERROR)"
