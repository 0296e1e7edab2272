"""``ray-resilient status RUN_DIR``: a run's checkpoints, attempts, goodput and restart point, on
local storage and on S3 (SeaweedFS), from real DCP checkpoints and a real goodput ledger."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest
import torch

from ray_resilient.checkpoint.layout import checkpoint_dir_name
from ray_resilient.checkpoint.state import TrainingComponents, TrainState
from ray_resilient.checkpoint.storage import CheckpointStorage
from ray_resilient.checkpoint.writer import AsyncCheckpointWriter
from ray_resilient.cli import main
from ray_resilient.faults import FaultInjector
from ray_resilient.goodput.ledger import LedgerWriter
from ray_resilient.storage.run import RunStorage


def write_run(filesystem: pafs.FileSystem, run_dir: str, local_dir: str) -> dict[str, str]:
    """Attempt 1 (2 workers) saves steps 5 and 10, then fails; attempt 2 (1 worker) restores 10 and
    is killed while saving 15 (partial). Checkpoint 10 is then truncated on storage. Returns the paths."""
    storage = CheckpointStorage(filesystem, run_dir, local_dir)
    writer = AsyncCheckpointWriter(storage, 0, FaultInjector([], 0, filesystem, f"{run_dir}/.faults"))
    torch.manual_seed(0)
    components = TrainingComponents(torch.nn.Linear(64, 64))
    for step in (5, 10):
        writer.save(components.state_to_save(TrainState(step=step), rank=0), step, checkpoint_dir_name(step, 0))
    assert all(result.ok for result in writer.collect())
    writer.close()
    filesystem.create_dir(f"{run_dir}/{checkpoint_dir_name(15, 1)}")  # a save that never finished
    paths = {step: f"{run_dir}/{checkpoint_dir_name(step, 0)}" for step in (5, 10)}
    shard = next(i for i in filesystem.get_file_info(pafs.FileSelector(paths[10])) if i.base_name.endswith(".distcp"))
    with filesystem.open_input_stream(shard.path) as stream:
        data = stream.read()
    with filesystem.open_output_stream(shard.path) as out:
        out.write(data[: len(data) // 2])

    def ledger(rank: int = 0) -> LedgerWriter:
        return LedgerWriter(RunStorage(filesystem, run_dir, local_dir), rank, upload_seconds=0.05)

    first = ledger()
    first.record("attempt_start", t=1.0, world_size=2)
    first.record("restore", t=2.0, t_start=1.5, step=0)
    for step in range(1, 13):
        first.record("step", t=2.0 + step, t_start=1.0 + step, step=step, data_wait=0.0)
    first.record("registered", t=8.0, step=5)
    first.record("registered", t=13.0, step=10)
    first.close()
    other_rank = ledger(rank=1)
    other_rank.record("failure", t=14.5, error="RuntimeError: injected")
    other_rank.close()
    second = ledger()
    second.record("attempt_start", t=20.0, world_size=1)
    second.record("restore", t=21.0, t_start=20.5, step=10)
    for step in range(11, 16):
        second.record("step", t=11.0 + step, t_start=10.0 + step, step=step, data_wait=0.0)
    second.close()
    return paths


def check_status(capsys, run_uri: str, paths: dict[int, str]) -> None:
    assert main(["status", run_uri, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    checkpoints = status["checkpoints"]
    assert [(c["step"], c["attempt"], c["complete"]) for c in checkpoints] == [(5, 0, True), (10, 0, True), (15, 1, False)]
    assert [c["registered"] for c in checkpoints] == [True, True, False]
    assert [c["verifies"] for c in checkpoints] == [True, False, None]
    assert "fails its checksum" in checkpoints[1]["problem"]
    assert checkpoints[0]["bytes"] > 64 * 64 * 4 and checkpoints[2]["bytes"] == 0
    # Checkpoint 10 is the newest complete one, but it no longer verifies: a restart loads 5.
    assert status["restart_would_load"] == paths[5]
    attempts = status["attempts"]
    assert [(a["world_size"], a["restored_step"], a["last_step"]) for a in attempts] == [(2, 0, 12), (1, 10, 15)]
    assert attempts[0]["ended"] == "failed: RuntimeError: injected"
    assert attempts[1]["ended"].startswith("running or killed")
    assert 0 < status["goodput"] < 1
    assert main(["status", run_uri]) == 0
    report = capsys.readouterr().out
    assert "does NOT verify: shard" in report and f"A restart would load: {status['restart_would_load']}" in report


def test_status_of_a_local_run(tmp_path, capsys):
    run_dir = str(tmp_path / "runs" / "r")
    paths = write_run(pafs.LocalFileSystem(), run_dir, str(tmp_path / "local"))
    check_status(capsys, run_dir, paths)


def test_status_of_a_run_on_s3(s3_server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_server.endpoint}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    run_dir = f"{s3_server.bucket}/status/r"
    paths = write_run(s3_server.filesystem(), run_dir, str(tmp_path / "local"))
    check_status(capsys, f"s3://{run_dir}", paths)


def test_symlinks_are_neither_followed_when_sizing_nor_taken_for_checkpoints(tmp_path, capsys):
    """A partial checkpoint holding a link to a directory of 1 MiB is sized without it; a
    ``checkpoint_*`` entry that links to ``/`` is skipped, saying so, and the command returns."""
    run_dir = tmp_path / "runs" / "r"
    write_run(pafs.LocalFileSystem(), str(run_dir), str(tmp_path / "local"))
    source = tmp_path / "source"
    source.mkdir()
    (source / "data.bin").write_bytes(b"x" * (1 << 20))
    partial = run_dir / checkpoint_dir_name(15, 1)
    (partial / "__0_0.distcp").write_bytes(b"y" * 100)
    (partial / "linked").symlink_to(source, target_is_directory=True)
    (run_dir / checkpoint_dir_name(20, 1)).symlink_to("/", target_is_directory=True)
    assert main(["status", str(run_dir), "--json", "--verify", "none"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["bytes"]) for c in status["checkpoints"]][-1] == (15, 100)
    assert status["skipped"] == [str(run_dir / checkpoint_dir_name(20, 1))]
    assert main(["status", str(run_dir), "--verify", "none"]) == 0
    assert f"skipped {run_dir / checkpoint_dir_name(20, 1)}: a symlink" in capsys.readouterr().out


def test_status_reads_the_summaries_a_restore_stored_and_says_the_same(tmp_path):
    """Once a restore stored the ended attempts' summaries, ``status`` reads them instead of their
    events (replaced here by bytes that are not text) and says what it said from the events."""
    from ray_resilient.goodput import read_ledger, store_summaries
    from ray_resilient.status import run_status

    run_dir = tmp_path / "runs" / "r"
    write_run(pafs.LocalFileSystem(), str(run_dir), str(tmp_path / "local"))
    from_events = run_status(str(run_dir), verify="none")
    store_summaries(pafs.LocalFileSystem(), str(run_dir), read_ledger(pafs.LocalFileSystem(), str(run_dir)).folded)
    summarized = {path.name.removesuffix(".summary") for path in (run_dir / "goodput").glob("*.summary")}
    assert len(summarized) == 2
    for log in (run_dir / "goodput").glob("*.jsonl"):
        if log.name.removesuffix(".jsonl") in summarized:
            log.write_bytes(b"\xff\xfe not text")
    assert run_status(str(run_dir), verify="none") == from_events


def status_error(capsys, *args: str) -> str:
    """The one-line usage error of ``ray-resilient status ARGS`` (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["status", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_the_storage_root_or_a_checkpoint_is_not_a_run_directory_and_says_what_to_pass(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r"
    write_run(pafs.LocalFileSystem(), str(run_dir), str(tmp_path / "local"))
    root = status_error(capsys, str(tmp_path / "runs"))
    assert f"{tmp_path / 'runs'} is not a run directory" in root and "it holds r: pass one of them" in root
    checkpoint = run_dir / checkpoint_dir_name(5, 0)
    assert f"is a checkpoint, not a run directory: pass its parent, {run_dir}" in status_error(capsys, str(checkpoint))


@pytest.mark.parametrize("verify", ["none", "newest", "all"])
def test_verify_checks_what_a_restart_would_try_every_checkpoint_or_none(tmp_path, capsys, verify):
    run_dir = str(tmp_path / "runs" / "r")
    paths = write_run(pafs.LocalFileSystem(), run_dir, str(tmp_path / "local"))
    for step in (12, 13):  # two complete checkpoints newer than the damaged 10
        storage = CheckpointStorage(pafs.LocalFileSystem(), run_dir, str(tmp_path / "local"))
        writer = AsyncCheckpointWriter(storage, 0, FaultInjector([], 0, storage.filesystem, f"{run_dir}/.faults"))
        writer.save(TrainingComponents(torch.nn.Linear(4, 4)).state_to_save(TrainState(step=step), rank=0), step,
                    checkpoint_dir_name(step, 0))
        assert writer.collect()[-1].ok
        writer.close()
        paths[step] = f"{run_dir}/{checkpoint_dir_name(step, 0)}"
    assert main(["status", run_dir, "--json", "--verify", verify]) == 0
    status = json.loads(capsys.readouterr().out)
    verified = {c["step"]: c["verifies"] for c in status["checkpoints"]}
    expected = {"none": {5: None, 10: None, 12: None, 13: None},
                "newest": {5: None, 10: None, 12: None, 13: True},  # a restart loads 13: nothing older is read
                "all": {5: True, 10: False, 12: True, 13: True}}[verify]
    assert {step: verified[step] for step in expected} == expected and verified[15] is None
    assert status["restart_would_load"] == paths[13] and not status["restart_would_refuse"]


def test_a_run_whose_checkpoints_all_fail_would_refuse_to_restart_not_start_fresh(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r"
    write_run(pafs.LocalFileSystem(), str(run_dir), str(tmp_path / "local"))
    (run_dir / checkpoint_dir_name(5, 0) / "checksums_rank_0.json").write_text("{")  # 10 is truncated already
    assert main(["status", str(run_dir), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["restart_would_refuse"] and status["restart_would_load"] is None
    assert [c["verifies"] for c in status["checkpoints"]] == [False, False, None]
    assert main(["status", str(run_dir)]) == 0
    assert "A restart would refuse to start (NoLoadableCheckpointError)" in capsys.readouterr().out


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    """``ray-resilient status RUN | head -1``: the reader closes early; no traceback."""
    import subprocess
    import sys

    run_dir = str(tmp_path / "runs" / "r")
    write_run(pafs.LocalFileSystem(), run_dir, str(tmp_path / "local"))
    command = [sys.executable, "-c", "import sys; from ray_resilient.cli import main; sys.exit(main())",
               "status", run_dir, "--verify", "none"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # before it writes anything
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and "Traceback" not in stderr and "Error" not in stderr, stderr


@pytest.mark.parametrize("rate, said", [
    (["--failures-per-day", "1e300"], "8.64e-296 s (1e+300 failures a day)"),
    (["--mtbf-hours", "1e300"], "3.6e+303 s (as given)"),
])
def test_a_failure_rate_no_plan_can_use_is_a_one_line_error(capsys, rate, said):
    with pytest.raises(SystemExit) as exit_info:
        main(["goodput", "plan", *rate, "--save-stall", "5s", "--step-time", "1s"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert said in err and "a plan needs 1 s to 1000 years" in err


def test_status_of_what_is_not_a_run_is_a_usage_error_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["status", str(tmp_path / "nothing")])
    assert exit_info.value.code == 2 and f"{tmp_path / 'nothing'} is not a directory" in capsys.readouterr().err
