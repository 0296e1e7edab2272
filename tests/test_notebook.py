"""The quickstart notebook, executed headless as a user would run it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ray_resilient.spare_workers import SPARE_WORKERS_ENV

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_trains_and_reports(tmp_path, ray_cluster, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    os.symlink(NOTEBOOK.parent.parent / "jobs", tmp_path / "jobs")
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)  # the kernel's trainer.fit() attaches to the session's cluster
    # No spare workers: the first run has no restart, the second's replacement joins survivors that train on.
    monkeypatch.setenv(SPARE_WORKERS_ENV, "0")
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for out in cell.get("outputs", []))
    assert "final checkpoint: " + str(tmp_path / "runs" / "notebook-quickstart" / "checkpoint_") in outputs
    accuracy = float(outputs.split("train accuracy: ")[1].split()[0])
    assert accuracy > 0.6  # 3 classes: chance is 0.33
    assert "goodput report of" in outputs and (tmp_path / "goodput-notebook.png").exists()
    # Survivor mode, replica 1 killed after step 5: one start from storage, the survivor trained on
    # without it (a replacement joins if it is up before the 21 steps end), and the run ended with
    # its final checkpoint.
    assert "restored from storage at steps: [0]\n" in outputs
    assert "replicas lost, joined: [([1], [])" in outputs
    assert "final checkpoint: " + str(tmp_path / "runs" / "notebook-survivors" / "checkpoint_0000000021") in outputs
