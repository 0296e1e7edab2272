"""A just-in-time checkpoint when Ray announces the preemption of a node (a real drain request)."""

from __future__ import annotations

import json
from typing import Any

import pyarrow.fs as pafs
import pytest

import trainlib
from ray_resilient import list_checkpoints
from ray_resilient.goodput import read_events
from ray_resilient.testing import Driver, wait_until

pytestmark = pytest.mark.slow


def fit_in_driver(config: dict[str, Any]) -> dict[str, str]:
    """Runs in the driver process: ``trainlib.preemption_fn`` until it ends, with no restarts allowed."""
    import ray

    ray.init(address=config["address"])
    result = trainlib.run_job(trainlib.preemption_fn, {"max_steps": 3000, "progress": config["progress"],
                                                       "faults": config["faults"]},
                              config["storage"], "preempt", max_failures=0, num_to_keep=None)
    assert result.error is None, result.error
    return {"checkpoint": result.checkpoint.path}


def test_preemption_notice_triggers_a_just_in_time_checkpoint(multi_node_cluster, tmp_path):
    """The just-in-time checkpoint's write takes 12 s more (the first save of the run: ``upload=1``)
    and every rank waits for it to be durable, making no progress: that wait is allowed what bounds
    it (``save_timeout_s``), not the 5 s a rank that answers is allowed here without progress, so
    no rank is declared hung and the checkpoint is made."""
    progress = tmp_path / "progress.json"
    config = {"address": multi_node_cluster.address, "progress": str(progress), "storage": str(tmp_path / "storage"),
              "faults": "slow_write:upload=1:seconds=12"}
    driver = Driver.start("test_preemption:fit_in_driver", config, env=multi_node_cluster.env, workdir=tmp_path)

    def trained_ten_steps() -> bool:
        assert driver.running(), f"the driver exited before training reached step 10:\n{driver.output()[-5000:]}"
        return progress.exists() and json.loads(progress.read_text() or "{}").get("step", -1) >= 10

    wait_until(trained_ten_steps, timeout=300, what="training to reach step 10")
    node_id = json.loads(progress.read_text())["node_id"]
    multi_node_cluster.ray("drain-node", f"--address={multi_node_cluster.address}", f"--node-id={node_id}",
                           "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot reclaim (test)",
                           "--deadline-remaining-seconds=600")
    final_path = driver.wait(timeout=300)["checkpoint"]
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "storage" / "preempt"))
    # The interval is 10**6 steps: the first checkpoint can only be the just-in-time one, taken at a
    # preemption check (every 5 steps) after the drain; the last is the final one, 5 steps later.
    assert len(checkpoints) == 2 and all(c.complete for c in checkpoints)
    jit, final = checkpoints
    assert jit.step >= 10 and jit.step % 5 == 0 and final.step == jit.step + 5
    assert final.path == final_path
    events = read_events(pafs.LocalFileSystem(), str(tmp_path / "storage" / "preempt"))
    assert not [e for e in events if e["kind"] == "hang"]
