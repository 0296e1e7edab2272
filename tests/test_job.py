"""The demo job end to end, as a user runs it: a subprocess with its own local Ray cluster."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from ray_resilient import list_checkpoints
from ray_resilient.faults import parse_faults
from ray_resilient.goodput import read_events
from ray_resilient.spare_workers import SPARE_WORKERS_ENV
from ray_resilient.testing import make_image_volume, wait_until

REPO = Path(__file__).parent.parent


@pytest.mark.slow
def test_train_ddp_job_survives_an_injected_worker_kill(tmp_path, ray_cluster, driver_env):
    env = driver_env
    cmd = [sys.executable, str(REPO / "jobs" / "train_ddp.py"), "--ray-address", ray_cluster, "--epochs", "2",
           "--samples", "1024", "--interval", "10", "--storage-path", str(tmp_path), "--name", "demo",
           "--faults", "kill:durable=20:rank=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    # Rank 1 dies the moment checkpoint 20 is durable (a kill at a fixed step could come before
    # the first save finished: a fast machine trains 15 steps in a second).
    assert "Injecting fault kill-durable-20-rank1" in log
    assert "Resuming at step 20" in log
    assert "Done: step 32" in log  # 2 epochs x 1024 // 64 batches
    # A worker's print reaches the driver once: with Ray Train's print patch it came twice. Epoch 0
    # ends at step 16, before the resumed step 20, so only one attempt prints it; epoch 1 may be
    # printed by both when the first attempt ran past step 32 before checkpoint 20 was durable.
    assert log.count("[rank 0] epoch 0: ") == 1
    assert log.count("[rank 0] 2 workers, starting at step 0 (epoch 0)") == 1
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(tmp_path / "demo"))
    assert checkpoints[-1].step == 32 and checkpoints[-1].complete
    assert f"Final checkpoint: {checkpoints[-1].path}" in log


def test_readme_shows_the_quickstart_example(tmp_path):
    readme = (REPO / "README.md").read_text()
    example = (REPO / "examples" / "quickstart.py").read_text()
    assert f"```python\n{example}```" in readme, "README's example differs from examples/quickstart.py"


@pytest.mark.slow
def test_quickstart_example_trains_and_resumes(image_dir, tmp_path, driver_env):
    env = {**driver_env, SPARE_WORKERS_ENV: "0"}  # the session's cluster; no restart follows either run
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


def test_the_image_jobs_survivor_options_are_checked_before_anything_starts(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_images", REPO / "jobs" / "train_images.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.parse_args(["--survivors", "--max-workers", "3", "--global-batch", "48"]).micro_batches == 3
    assert job.parse_args(["--survivors", "--micro-batches", "4"]).micro_batches == 4
    for arguments, named in ((["--survivors", "--parallelism", "fsdp"], "does not combine with --parallelism fsdp"),
                             (["--micro-batches", "4"], "add --survivors"),
                             (["--survivors", "--micro-batches", "3"], "divide --global-batch (64), got 3"),
                             (["--survivors", "--max-workers", "4", "--micro-batches", "2"], "at least --max-workers")):
        with pytest.raises(SystemExit) as exit:
            job.parse_args(arguments)
        assert exit.value.code == 2 and named in capsys.readouterr().err, arguments


PROMISED_VAL_ACCURACY = 0.9  # the README: "above 90% validation accuracy"


def demo_job_arguments() -> list[str]:
    """The arguments the README's first command (``scripts/demo.sh``) gives ``jobs/train_images.py``."""
    line = next(line for line in (REPO / "scripts" / "demo.sh").read_text().splitlines() if line.startswith("exec "))
    words = shlex.split(line)
    return [word for word in words[words.index("jobs/train_images.py") + 1:] if word != "$@"]


@dataclass
class ImageJob:
    """``jobs/train_images.py`` running as a user runs it, in ``cwd`` (its ./data and ./runs go
    there, its output to ``cwd/job.log``)."""

    process: subprocess.Popen
    cwd: Path

    @classmethod
    def start(cls, cwd: Path, arguments: list[str], env: dict[str, str] | None = None) -> "ImageJob":
        """By default on a Ray instance of its own, else on the cluster ``env``'s ``RAY_ADDRESS`` names."""
        if env is None:
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        cwd.mkdir(exist_ok=True)
        with open(cwd / "job.log", "w") as log:
            process = subprocess.Popen([sys.executable, str(REPO / "jobs" / "train_images.py"), *arguments], env=env,
                                       cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        return cls(process, cwd)

    def result(self, timeout: float = 900) -> tuple[str, dict]:
        """Its output once it succeeded, and its ``RESULT`` line."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            self.process.kill()
        log = (self.cwd / "job.log").read_text()
        assert self.process.returncode == 0, log[-5000:]
        return log, json.loads(log.split("RESULT ", 1)[1].splitlines()[0])


def run_image_job(cwd: Path, arguments: list[str], env: dict[str, str] | None = None) -> tuple[str, dict]:
    """:meth:`ImageJob.start`, then its :meth:`ImageJob.result`."""
    return ImageJob.start(cwd, arguments, env).result()


def exported_model_accuracy(model_file: Path, val_dir: Path) -> float:
    """The exported model's accuracy on ``val_dir``, in a Python without Ray or ray_resilient."""
    script = textwrap.dedent(f"""
        import pathlib, sys, torch, torchvision
        from torchvision.io import decode_image
        saved = torch.load({str(model_file)!r})
        model = torchvision.models.get_model(saved["model"], num_classes=len(saved["classes"]))
        model.load_state_dict(saved["state_dict"])
        model.eval()
        files = sorted(pathlib.Path({str(val_dir)!r}).glob("*/*.jpg"))
        images = torch.stack([decode_image(str(f)) for f in files]).float() / 255
        labels = torch.tensor([saved["classes"].index(f.parent.name) for f in files])
        with torch.no_grad():
            print("accuracy", (model(images).argmax(1) == labels).float().mean().item())
        assert not any(m.split(".")[0] in ("ray", "ray_resilient") for m in sys.modules)
    """)
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    return float(loaded.stdout.split("accuracy ")[1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--survivors"]], ids=["mainline", "survivors"])
def test_the_readme_first_command_recovers_its_kill_and_learns_as_promised(mode, tmp_path, request, driver_env):
    """The README's first command's job, exactly (its arguments and its kill), against the README's
    promise; then the same job uninterrupted: the kill must not change what the job learns, down to
    the last bit of the ResNet's whole state (parameters and BatchNorm buffers). The same with
    ``--survivors`` (the README's survivor-mode command): the kill costs the survivors no restart."""
    arguments = demo_job_arguments() + mode
    assert "--faults" in arguments, "scripts/demo.sh no longer injects its kill"
    assert f"above {PROMISED_VAL_ACCURACY:.0%} validation accuracy" in " ".join((REPO / "README.md").read_text().split())
    # The uninterrupted job runs alongside, on the session's cluster with an MLflow store of its
    # own (half of each run is Ray and its workers starting, which overlaps), and without spare
    # workers: no restart follows, their imports would only take CPU from the two jobs.
    faults = arguments.index("--faults")
    without_kill = arguments[:faults] + arguments[faults + 2:]
    alongside = ImageJob.start(tmp_path / "uninterrupted", without_kill, {
        **driver_env, SPARE_WORKERS_ENV: "0", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/uninterrupted/mlflow.db"})
    request.addfinalizer(alongside.process.kill)
    log, killed = run_image_job(tmp_path / "killed", arguments)
    for fault in parse_faults(arguments[arguments.index("--faults") + 1]):
        assert f"Injecting fault {fault.marker}" in log
    run_dir = tmp_path / "killed" / "runs" / "train_images"
    if mode:  # one worker group throughout: the survivors trained on, a replacement joined them
        events = read_events(pafs.LocalFileSystem(), str(run_dir))
        assert [e["step"] for e in events if e["kind"] == "restore"] == [0]
        changes = [(e["lost"], e["joined"]) for e in events if e["kind"] == "membership"]
        assert changes == [([1], []), ([], [1])], changes
        assert log.count("[survivors] ") == 1 and "[attempt 2]" not in log
    else:
        assert "[attempt 2]" in log
        assert_console_tells_the_readmes_story(log)
        # A death is no hang: the rank left waiting for the killed one is not declared hung.
        assert "declared hung" not in log
        assert not [e for e in read_events(pafs.LocalFileSystem(), str(run_dir)) if e["kind"] == "hang"]
    assert killed["val_accuracy"] >= PROMISED_VAL_ACCURACY and 0 < killed["goodput"] < 1
    assert (run_dir / "goodput_timeline.png").stat().st_size > 10_000
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(run_dir))
    assert checkpoints[-1].complete and checkpoints[-1].step == killed["step"]
    exported = exported_model_accuracy(run_dir / "final_model.pt", tmp_path / "killed" / "data" / "shapes" / "val")
    assert exported == pytest.approx(killed["val_accuracy"], abs=0.01)  # batched differently: a tie may flip

    log, uninterrupted = alongside.result()
    assert "Injecting fault" not in log and "[attempt 2]" not in log
    assert uninterrupted["step"] == killed["step"]
    assert uninterrupted["val_accuracy"] == killed["val_accuracy"]
    killed_state = torch.load(run_dir / "final_model.pt")["state_dict"]
    uninterrupted_dir = tmp_path / "uninterrupted" / "runs" / "train_images"
    uninterrupted_state = torch.load(uninterrupted_dir / "final_model.pt")["state_dict"]
    assert killed_state.keys() == uninterrupted_state.keys()
    assert any("running_mean" in key for key in killed_state)
    differing = [key for key in killed_state if not torch.equal(killed_state[key], uninterrupted_state[key])]
    assert not differing, f"{len(differing)} of {len(killed_state)} tensors differ: {differing[:5]}"


ANSI = re.compile(r"\x1b\[[0-9;]*m")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def readme_excerpt() -> list[str]:
    """The lines of the README's sample output of its first command (a "…" stands for anything)."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("What you see", 1)[1].split("```\n", 2)[1]
    return [line for line in block.splitlines() if line.strip() not in ("", "…")]


def excerpt_pattern(line: str) -> re.Pattern:
    """A README output line as a pattern: any number where it has one, anything for "…", any run of spaces."""
    parts = []
    for piece in re.split(r"(…|\d+(?:\.\d+)?|\s+)", line.strip()):
        if piece == "…":
            parts.append(".*")
        elif NUMBER.fullmatch(piece or "x"):
            parts.append(NUMBER.pattern)
        elif piece.isspace():
            parts.append(r"\s+")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts))


def assert_console_tells_the_readmes_story(log: str) -> None:
    """Every line of the README's excerpt is in the job's output (numbers aside; the order of lines
    from different processes is not fixed), and the output of the run, which succeeded through its
    kill, holds no traceback."""
    lines = [ANSI.sub("", line).strip() for line in log.splitlines()]
    assert not [line for line in lines if "Traceback" in line], log[-5000:]
    missing = [expected for expected in readme_excerpt()
               if not any(excerpt_pattern(expected).fullmatch(line) for line in lines)]
    assert not missing, f"the README's lines {missing} are not in the output:\n{log}"


@pytest.fixture(scope="module")
def fsdp_image_run(tmp_path_factory, ray_cluster) -> dict:
    """The image job with FSDP2 on a volume of 160 training JPEGs (``A``; ``B`` has 192), 20 steps
    of 16 images, a checkpoint every 2, and an MLflow tracking store that is not a database. Once
    checkpoint 4 is durable, its rank 1 is SIGSTOPped from outside (at a moment the job did not
    choose). Its output, RESULT, run directory and arguments, and the stopped process and when."""
    root = tmp_path_factory.mktemp("fsdp-image")
    for name, per_class in (("A", 40), ("B", 48)):
        for split, count in (("train", per_class), ("val", 10)):
            make_image_volume(pafs.LocalFileSystem(), str(root / name / split), classes=4, per_class=count, size=32,
                              seed=1)
    run_dir = root / "runs" / "r"
    arguments = ["--parallelism", "fsdp", "--epochs", "2", "--global-batch", "16", "--interval", "2",
                 "--storage-path", str(root / "runs"), "--name", "r"]
    (root / "broken.db").write_text("not a database")
    job = ImageJob.start(root, ["--volume", str(root / "A"), "--tracking-uri", f"sqlite:///{root}/broken.db",
                                *arguments], {**os.environ, "RAY_ADDRESS": ray_cluster})
    stopped = 0
    try:
        def checkpoint_4_durable() -> bool:
            assert job.process.poll() is None, (root / "job.log").read_text()[-5000:]
            return run_dir.exists() and any(c.complete and c.step >= 4
                                            for c in list_checkpoints(pafs.LocalFileSystem(), str(run_dir)))

        wait_until(checkpoint_4_durable, timeout=600, what="checkpoint 4 of the image job to be durable")
        rank1_log = max((f for f in (run_dir / "goodput").iterdir() if "-rank1-" in f.name), key=lambda f: f.name)
        stopped = int(rank1_log.name.split("-")[2].split(".")[0])  # <time>-rank1-<pid>.jsonl
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        log, result = job.result()
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):  # the hang watchdog killed it
                os.kill(stopped, signal.SIGKILL)
    return {"root": root, "log": log, "result": result, "run_dir": run_dir, "arguments": arguments,
            "stopped": stopped, "stopped_at": stopped_at}


@pytest.mark.slow
def test_the_image_job_with_fsdp2_recovers_a_lost_worker_and_exports_the_whole_model(fsdp_image_run):
    log, result, run_dir = fsdp_image_run["log"], fsdp_image_run["result"], fsdp_image_run["run_dir"]
    restored = [e["step"] for e in read_events(pafs.LocalFileSystem(), str(run_dir)) if e["kind"] == "restore"]
    assert "[attempt 2]" in log and restored[0] == 0 and restored[1] >= 4 and f"Resuming at step {restored[1]}" in log
    checkpoints = list_checkpoints(pafs.LocalFileSystem(), str(run_dir))
    assert checkpoints[-1].complete and checkpoints[-1].step == result["step"] == 20
    # The shards of both ranks, gathered into one plain state dict, give the job's own accuracy.
    exported = exported_model_accuracy(run_dir / "final_model.pt", fsdp_image_run["root"] / "A" / "val")
    assert exported == pytest.approx(result["val_accuracy"], abs=0.03)


@pytest.mark.slow
def test_a_worker_of_the_image_job_stopped_from_outside_is_declared_hung_and_replaced_within_seconds(fsdp_image_run):
    """Ray would replace the stopped worker after its health-check timeout (60 s in the recommended
    environment, 600 s in Ray's); the job's hang watchdog declares it hung and kills it, and the
    job's goodput report shows the hang."""
    log, run_dir = fsdp_image_run["log"], fsdp_image_run["run_dir"]
    hang, = [e for e in read_events(pafs.LocalFileSystem(), str(run_dir)) if e["kind"] == "hang"]
    assert hang["hung_rank"] == 1 and hang["pid"] == fsdp_image_run["stopped"] and "does not answer" in hang["error"]
    assert hang["t"] - fsdp_image_run["stopped_at"] < 30, hang
    assert "declared hung" in log and f"pid {fsdp_image_run['stopped']}" in log
    assert "goodput report of" in log, log[-3000:]
    report = log.split("goodput report of", 1)[1]
    assert any(line.split()[:1] == ["hang"] for line in report.splitlines()), report


@pytest.mark.slow
def test_a_broken_mlflow_store_costs_the_image_job_nothing(fsdp_image_run):
    """Its tracking store is not a database: telemetry fails, the run must not (its one restart is
    the stopped worker's)."""
    log = fsdp_image_run["log"]
    assert "could not add final_model.pt to the MLflow run" in log
    assert "[attempt 3]" not in log  # its one restart: the stopped worker's
    assert "could not add goodput_timeline.png to the MLflow run" in log


@pytest.mark.slow
def test_the_image_job_on_a_changed_dataset_stops_at_once_and_keeps_every_checkpoint(fsdp_image_run, driver_env):
    """The same run name on a volume with more images: the saved data position does not fit. The
    run must end at the first attempt with an error naming the checkpoint and the change, instead of
    falling back, starting fresh or spending its restarts, and keep every checkpoint."""
    root, run_dir = fsdp_image_run["root"], str(fsdp_image_run["run_dir"])
    before = list_checkpoints(pafs.LocalFileSystem(), run_dir)
    assert before[-1].complete
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "train_images.py"), "--volume", str(root / "B"),
                          *fsdp_image_run["arguments"]], capture_output=True, text=True, timeout=900, env=driver_env,
                         cwd=root)
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "IncompatibleCheckpointError" in log and f"checkpoint {before[-1].path}" in log, log[-5000:]
    assert "saved for another volume listing" in log and "start it as a new run" in log
    assert "[attempt 2]" not in log and "starting fresh" not in log
    assert list_checkpoints(pafs.LocalFileSystem(), run_dir) == before
