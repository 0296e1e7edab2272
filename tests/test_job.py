"""The demo job end to end, as a user runs it: a subprocess with its own local Ray cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from ray_resilient import list_checkpoints

REPO = Path(__file__).parent.parent


@pytest.mark.slow
def test_train_ddp_job_survives_an_injected_worker_kill(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(REPO / "jobs" / "train_ddp.py"), "--ray-address", "local", "--epochs", "2",
           "--samples", "1024", "--interval", "10", "--storage-path", str(tmp_path), "--name", "demo",
           "--faults", "kill:step=25:rank=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "Injecting fault kill-step-25-rank1" in log
    assert "Resuming at step 20" in log or "Resuming at step 10" in log  # 20 may still be in flight
    assert "Done: step 32" in log  # 2 epochs x 1024 // 64 batches
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "demo"))
    assert checkpoints[-1].step == 32 and checkpoints[-1].complete
    assert f"Final checkpoint: {checkpoints[-1].path}" in log


def test_readme_shows_the_quickstart_example(tmp_path):
    readme = (REPO / "README.md").read_text()
    example = (REPO / "examples" / "quickstart.py").read_text()
    assert f"```python\n{example}```" in readme, "README's example differs from examples/quickstart.py"


@pytest.mark.slow
def test_quickstart_example_trains_and_resumes(image_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(REPO / "examples" / "quickstart.py"), image_dir, str(tmp_path / "runs"), "2"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "runs" / "quickstart"))
    final = checkpoints[-1]
    assert final.complete and final.step == 2 * (69 // 32)  # 69 images, global batch 32, 2 epochs
    assert f"final checkpoint {final.path}" in first.stdout
    # The same command with more epochs resumes the run where it ended.
    again = subprocess.run(cmd[:-1] + ["3"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    assert f"Resuming at step {final.step}" in again.stdout + again.stderr
    assert list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "runs" / "quickstart"))[-1].step == 3 * (69 // 32)
