"""The demo job end to end, as a user runs it: a subprocess with its own local Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
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


@pytest.mark.slow
def test_image_job_on_the_embedded_default_recovers_a_kill_and_learns(tmp_path):
    """The main job as the README's first command runs it (smaller), then its model without Ray."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(REPO / "jobs" / "train_images.py"), "--ray-address", "local", "--per-class", "150",
           "--epochs", "3", "--interval", "10", "--faults", "kill:step=15:rank=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "Injecting fault kill-step-15-rank1" in log and "[attempt 2]" in log
    result = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    assert result["val_accuracy"] >= 0.9 and 0 < result["goodput"] < 1
    assert (tmp_path / "runs" / "train_images" / "goodput_timeline.png").stat().st_size > 10_000
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "runs" / "train_images"))
    assert checkpoints[-1].complete and checkpoints[-1].step == result["step"]
    script = textwrap.dedent(f"""
        import pathlib, sys, torch, torchvision
        from torchvision.io import decode_image
        from torchvision.transforms import v2
        saved = torch.load({str(tmp_path / "runs" / "train_images" / "final_model.pt")!r})
        model = torchvision.models.get_model(saved["model"], num_classes=len(saved["classes"]))
        model.load_state_dict(saved["state_dict"])
        model.eval()
        files = sorted(pathlib.Path({str(tmp_path / "data" / "shapes" / "val")!r}).glob("*/*.jpg"))
        images = torch.stack([v2.ToDtype(torch.float32, scale=True)(decode_image(str(f))) for f in files])
        labels = torch.tensor([saved["classes"].index(f.parent.name) for f in files])
        print("accuracy", (model(images).argmax(1) == labels).float().mean().item())
        assert not any(m.split(".")[0] in ("ray", "ray_resilient") for m in sys.modules)
    """)
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert float(loaded.stdout.split("accuracy ")[1]) >= 0.8
