"""A just-in-time checkpoint when Ray announces the preemption of a node (a real drain request)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow.fs as pafs
import pytest

from conftest import wait_until
from ray_resilient import list_checkpoints

pytestmark = pytest.mark.slow


def test_preemption_notice_triggers_a_just_in_time_checkpoint(multi_node_cluster, tmp_path):
    progress = tmp_path / "progress.json"
    driver = textwrap.dedent(f"""
        import ray, trainlib
        ray.init(address={multi_node_cluster.address!r})
        result = trainlib.run_job(trainlib.preemption_fn, {{"max_steps": 3000, "progress": {str(progress)!r}}},
                                  {str(tmp_path / "storage")!r}, "preempt", max_failures=0, num_to_keep=None)
        assert result.error is None, result.error
        print("FINAL", result.checkpoint.path)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], env=multi_node_cluster.env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def trained_ten_steps() -> bool:
        assert proc.poll() is None, "the driver exited before training reached step 10"
        return progress.exists() and json.loads(progress.read_text() or "{}").get("step", -1) >= 10

    wait_until(trained_ten_steps, timeout=300, what="training to reach step 10")
    node_id = json.loads(progress.read_text())["node_id"]
    multi_node_cluster.ray("drain-node", f"--address={multi_node_cluster.address}", f"--node-id={node_id}",
                           "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot reclaim (test)",
                           "--deadline-remaining-seconds=600")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-5000:]
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "storage" / "preempt"))
    # The interval is 10**6 steps: the first checkpoint can only be the just-in-time one, taken at a
    # preemption check (every 5 steps) after the drain; the last is the final one, 5 steps later.
    assert len(checkpoints) == 2 and all(c.complete for c in checkpoints)
    jit, final = checkpoints
    assert jit.step >= 10 and jit.step % 5 == 0 and final.step == jit.step + 5
    assert f"FINAL {final.path}" in output
