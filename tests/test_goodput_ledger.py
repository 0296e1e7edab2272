"""The goodput ledger and its accounting, on event streams whose answers are computed by hand."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from ray_resilient.goodput import account, measured_inputs, read_events
from ray_resilient.goodput.ledger import FAN_IN, LedgerWriter
from ray_resilient.goodput.report import render_report
from ray_resilient.storage import RunStorage


def write_run(filesystem: pafs.FileSystem, run_dir: str, local_dir: str) -> None:
    """Driver 1 starts at 0 s. Attempt A restores nothing, trains steps 1-4 (checkpoint at 2) and
    is killed. Attempt B restores step 2, recomputes 3-4, checkpoints 4; then the driver dies.
    Driver 2 starts at 20 s; attempt C restores step 4, trains step 5, saves it, finishes at 26 s."""
    def writer(rank: int = 0) -> LedgerWriter:
        return LedgerWriter(RunStorage(filesystem, run_dir, local_dir), rank, upload_seconds=0.05)

    driver = writer(rank=-1)
    driver.record("job_start", t=0.0)
    driver.close()
    a = writer()
    a.record("attempt_start", t=2.0, world_size=2)
    a.record("restore", t=4.0, t_start=3.0, step=0)
    a.record("step", t=5.0, t_start=4.0, step=1, data_wait=0.2)
    a.record("step", t=6.0, t_start=5.0, step=2, data_wait=0.0)
    a.record("save", t=6.5, t_start=6.0, step=2)
    a.record("step", t=7.5, t_start=6.5, step=3, data_wait=0.0)
    a.record("durable", t=7.6, step=2)
    a.record("step", t=8.5, t_start=7.5, step=4, data_wait=0.0)
    a.close()
    b = writer()
    b.record("attempt_start", t=12.0, world_size=1)
    b.record("restore", t=14.0, t_start=13.0, step=2)
    b.record("step", t=15.0, t_start=14.0, step=3, data_wait=0.0)
    b.record("step", t=16.0, t_start=15.0, step=4, data_wait=0.0)
    b.record("save", t=16.5, t_start=16.0, step=4)
    b.close()
    b_rank1 = writer(rank=1)
    b_rank1.record("failure", t=16.6, error="RuntimeError: connection reset")
    b_rank1.close()
    driver = writer(rank=-1)
    driver.record("job_start", t=20.0)
    driver.close()
    c = writer()
    c.record("attempt_start", t=22.0, world_size=2)
    c.record("restore", t=23.5, t_start=23.0, step=4)
    c.record("step", t=24.5, t_start=23.5, step=5, data_wait=0.5)
    c.record("save", t=25.0, t_start=24.5, step=5)
    c.record("finish", t=26.0, step=5)
    c.close()


HAND_COMPUTED = {
    "total": 26.0,
    "productive": (1 - 0.2) + 1 + 1 + 1 + (1 - 0.5),  # A's steps 1-2, B's 3-4, C's 5, less data waits
    "wasted": 2.0,  # A's steps 3 and 4: B restored step 2 and trained them again
    "data_wait": 0.2 + 0.5,
    "save_stall": 0.5 * 3,
    "restore": 1.0 + 1.0 + 0.5,
    "init_restart": (3 - 0) + (13 - 8.5) + (23 - 16.5),  # to each attempt's first work
    "other": 26 - 25,  # C: from the end of its last save to its finish
}


@pytest.fixture
def local_run(tmp_path):
    run_dir = str(tmp_path / "runs" / "r")
    write_run(pafs.LocalFileSystem(), run_dir, str(tmp_path / "spool"))
    return run_dir


def test_breakdown_of_a_run_with_a_failure_recomputed_steps_and_a_driver_rerun(local_run):
    breakdown = account(read_events(pafs.LocalFileSystem(), local_run))
    for part, seconds in HAND_COMPUTED.items():
        assert getattr(breakdown, part) == pytest.approx(seconds), part
    assert sum(HAND_COMPUTED[p] for p in HAND_COMPUTED if p != "total") == pytest.approx(26.0)
    assert breakdown.goodput == pytest.approx(4.3 / 26)
    assert (breakdown.attempts, breakdown.failures, breakdown.steps_kept, breakdown.steps_recomputed) == (3, 2, 5, 2)


def write_slowed_run(fs: pafs.FileSystem, run_dir: str, local_dir: str) -> None:
    """One attempt, 30 steps: 20 of 1 s, then 5 of 2.5 s (a slowed node), the first of them waiting
    1.5 s for data (1 s of compute: not slow), then 5 of 1 s."""
    ledger = LedgerWriter(RunStorage(fs, run_dir, local_dir), 0, upload_seconds=0.05)
    ledger.record("attempt_start", t=0.0, world_size=2)
    ledger.record("restore", t=1.0, t_start=0.0, step=0)
    t = 1.0
    for step in range(1, 31):
        duration = 2.5 if 21 <= step <= 25 else 1.0
        ledger.record("step", t=t + duration, t_start=t, step=step, data_wait=1.5 if step == 21 else 0.0)
        t += duration
    ledger.record("finish", t=t, step=30)
    ledger.close()


def test_steps_slower_than_the_runs_best_steady_stretch_are_slow_steps_not_productive(tmp_path, capsys, monkeypatch):
    fs, run_dir = pafs.LocalFileSystem(), str(tmp_path / "runs" / "slowed")
    write_slowed_run(fs, run_dir, str(tmp_path / "spool"))
    breakdown = account(read_events(fs, run_dir))
    assert breakdown.reference_step_seconds == pytest.approx(1.0)  # the first 20 steps' median
    assert breakdown.slow_steps == pytest.approx(4 * 1.5)  # steps 22-25; step 21 waited for data instead
    assert breakdown.productive == pytest.approx(30.0) and breakdown.data_wait == pytest.approx(1.5)
    assert breakdown.total == pytest.approx(1.0 + 20 + 5 * 2.5 + 5)
    assert breakdown.other == pytest.approx(0.0)  # the parts still add up to the total
    # Against another mode's step time (0.5 s): every kept step's compute beyond it.
    against = account(read_events(fs, run_dir), reference_step_seconds=0.5)
    assert against.slow_steps == pytest.approx(26 * 0.5 + 4 * 2.0) and against.productive == pytest.approx(15.0)
    monkeypatch.chdir(tmp_path)
    out, _ = report_cli(capsys, run_dir, "--json", "--reference-step-seconds", "0.5")
    result = json.loads(out)
    assert result["slow_steps"] == pytest.approx(21.0) and result["shares"]["slow_steps"] == pytest.approx(21.0 / 38.5)
    assert result["reference_step_seconds"] == 0.5


def test_the_live_figures_count_slow_steps_as_the_ledger_does(tmp_path):
    import time

    from ray_resilient.checkpoint.goodput_recorder import GoodputRecorder

    fs, run_dir = pafs.LocalFileSystem(), str(tmp_path / "runs" / "slowed")
    write_slowed_run(fs, run_dir, str(tmp_path / "spool"))
    recorder = GoodputRecorder(RunStorage(fs, run_dir, str(tmp_path / "local")), 0)
    recorder.restored(time.time(), 30)
    now = time.time()
    for step in range(31, 36):  # the run goes on with 5 steps of 3 s
        recorder.step(step, now + 3 * (step - 31), now + 3 * (step - 30), data_wait=0.0)
    metrics = recorder.metrics()
    recorder.close()
    assert metrics["reference_step_seconds"] == pytest.approx(1.0)
    assert metrics["slow_steps_seconds"] == pytest.approx(4 * 1.5 + 5 * 2.0)
    assert metrics["productive_seconds"] == pytest.approx(35.0)


def test_an_attempt_killed_before_its_restore_charges_no_kept_step_as_wasted(tmp_path):
    """The real run of issue 14: 4 attempts, one killed before its restore, the others resuming at
    step 20, final step 72. A: fresh, steps 1-25 (checkpoint 20), killed; B: killed while starting;
    C: restores 20, steps 21-27, killed; D: restores 20, steps 21-72, finishes."""
    fs, run_dir = pafs.LocalFileSystem(), str(tmp_path / "runs" / "r")
    t = 0.0
    for name, restored, last in (("A", 0, 25), ("B", None, None), ("C", 20, 27), ("D", 20, 72)):
        ledger = LedgerWriter(RunStorage(fs, run_dir, str(tmp_path / "spool")), 0, upload_seconds=0.05)
        t += 1
        ledger.record("attempt_start", t=t, world_size=2)
        if restored is not None:
            ledger.record("restore", t=t + 1, t_start=t, step=restored)
            t += 1
            for step in range(restored + 1, last + 1):
                ledger.record("step", t=t + 1, t_start=t, step=step, data_wait=0.0)
                t += 1
        if name == "D":
            ledger.record("finish", t=t, step=72)
        ledger.close()
    breakdown = account(read_events(fs, run_dir))
    assert (breakdown.attempts, breakdown.failures) == (4, 3)
    assert breakdown.steps_kept == 72 and breakdown.steps_recomputed == (25 - 20) + (27 - 20)
    assert breakdown.productive == pytest.approx(72.0) and breakdown.wasted == pytest.approx(12.0)


def test_an_upload_to_slow_storage_never_holds_up_record(tmp_path):
    """Storage that hangs in the middle of an upload (a real filesystem: local files behind a gate)."""
    import threading

    from fsspec.implementations.local import LocalFileSystem

    entered, release = threading.Event(), threading.Event()

    class HangingUploads(LocalFileSystem):
        def _open(self, path, mode="rb", **kwargs):
            if "w" in mode:
                entered.set()
                release.wait(60)
            return super()._open(path, mode, **kwargs)

    fs = pafs.PyFileSystem(pafs.FSSpecHandler(HangingUploads()))
    ledger = LedgerWriter(RunStorage(fs, str(tmp_path / "runs" / "r"), str(tmp_path / "spool")), 0, upload_seconds=3600)
    ledger.record("attempt_start", world_size=1)
    uploading = threading.Thread(target=ledger.flush)
    uploading.start()
    assert entered.wait(60)
    recorded = threading.Thread(target=lambda: [ledger.record("step", step=s, t_start=0.0) for s in range(100)])
    recorded.start()
    recorded.join(timeout=30)
    stuck = recorded.is_alive()
    release.set()
    uploading.join()
    recorded.join()
    assert not stuck, "record() waited for the upload"
    ledger.close()
    kinds = [e["kind"] for e in read_events(pafs.LocalFileSystem(), str(tmp_path / "runs" / "r"))]
    assert kinds == ["attempt_start"] + ["step"] * 100  # nothing lost: the next upload took the rest


def open_descriptor(directory: str) -> int:
    """The descriptor this process holds open on a file in ``directory``."""
    import os

    fds = [int(fd) for fd in os.listdir("/proc/self/fd")
           if os.path.dirname(os.path.realpath(f"/proc/self/fd/{fd}")) == os.path.realpath(directory)]
    assert len(fds) == 1, fds
    return fds[0]


def test_a_full_disk_under_the_spool_loses_events_counted_and_training_goes_on(tmp_path, caplog):
    """Rank 0's spool on a full disk (its descriptor pointed at /dev/full: every write fails with
    ENOSPC): steps and saves go on without an error, each lost event is counted, reported in the
    goodput metrics and warned about at the 1st, 2nd, 4th... loss; once the disk works again, later
    events reach the ledger (the lost ones do not)."""
    import os
    import time

    from ray_resilient.checkpoint.goodput_recorder import GoodputRecorder

    fs = pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem())  # remote: a local spool
    spool = tmp_path / "spool"
    recorder = GoodputRecorder(RunStorage(fs, "run", str(spool)), 0)
    recorder.attempt_started(1)
    recorder.restored(time.time(), 0)
    descriptor = open_descriptor(str(spool))
    disk = os.dup(descriptor)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, descriptor)
    with caplog.at_level("WARNING", logger="ray_resilient.goodput.ledger"):
        for step in range(1, 6):
            recorder.step(step, float(step), step + 1.0, data_wait=0.0)
        recorder.save(5, 6.0, 6.5)
    assert recorder.metrics()["ledger_events_lost"] == 6
    assert caplog.text.count("No space left on device") == 3  # losses 1, 2 and 4
    os.dup2(disk, descriptor)
    for fd in (disk, full):
        os.close(fd)
    recorder.step(6, 7.0, 8.0, data_wait=0.0)
    recorder.close()
    events = read_events(fs, "run")
    assert sorted(e["kind"] for e in events) == ["attempt_start", "restore", "step"]
    assert [e["step"] for e in events if e["kind"] == "step"] == [6]


# Each attempt's start, to its first work, plus its restore: the job's first start and two restarts.
STARTS = ((3 - 0) + 1, (13 - 8.5) + 1, (23 - 16.5) + 0.5)


def test_measured_inputs_are_the_runs_medians_and_its_mean_start(local_run):
    measured = measured_inputs(local_run)
    assert measured.save_stall_s == pytest.approx(0.5)
    assert measured.restart_s == pytest.approx(sum(STARTS) / 3)  # the first start counts as a restart
    assert measured.step_s == pytest.approx(1.0)  # kept steps less data wait: 0.8, 1, 1, 1, 0.5
    assert measured.durable_latency_s == pytest.approx(7.6 - 6.0)  # the one save seen durable: started at 6.0
    assert measured.save_interference_s == 0.0  # the steps beside its write (3, 4) were lost, not kept


def test_what_a_saves_write_cost_the_steps_beside_it_is_measured_and_planned_for(tmp_path):
    """40 steps of 1 s; save 10's write (durable during step 13) runs beside steps 11-13, which take
    1.3 s; save 30's (durable during step 31) beside step 31, which takes 1 s. Interference: 0.9 s
    and 0 s, a mean of 0.45 s; the plan charges each save its stall and that, so its interval is
    Daly's for 0.65 s, not for the 0.2 s stall alone."""
    from ray_resilient.goodput.planner import daly_interval, plan_from_measured

    run_dir = str(tmp_path / "run")
    ledger = LedgerWriter(RunStorage(pafs.LocalFileSystem(), run_dir, str(tmp_path / "spool")), 0)
    ledger.record("attempt_start", t=0.0, world_size=2)
    ledger.record("restore", t=1.0, t_start=0.0, step=0)
    t = 1.0
    for step in range(1, 41):
        duration = 1.3 if 11 <= step <= 13 else 1.0
        ledger.record("step", t=t + duration, t_start=t, step=step, data_wait=0.0)
        t += duration
        if step == 13:
            ledger.record("durable", t=t - 0.1, step=10)
        if step == 31:
            ledger.record("durable", t=t - 0.5, step=30)
        if step in (10, 30):
            ledger.record("save", t=t + 0.2, t_start=t, step=step)
            t += 0.2
    ledger.record("finish", t=t, step=40)
    ledger.close()
    breakdown = account(read_events(pafs.LocalFileSystem(), run_dir))
    assert breakdown.write_windows == [(3, pytest.approx(3.9)), (1, pytest.approx(1.0))]
    assert breakdown.save_interference == [pytest.approx(0.9), pytest.approx(0.0)]
    measured = measured_inputs(run_dir)
    assert measured.save_stall_s == pytest.approx(0.2) and measured.save_interference_s == pytest.approx(0.45)
    plan = plan_from_measured(measured, 3600.0)
    assert plan.save_interference_s == pytest.approx(0.45)
    assert plan.daly_interval_s == pytest.approx(daly_interval(0.65, 3600.0))
    assert plan.daly_interval_s > daly_interval(0.2, 3600.0)


def test_a_run_without_a_ledger_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="has no goodput ledger"):
        measured_inputs(str(tmp_path))


def test_a_torn_last_line_is_skipped(local_run):
    files = sorted(pafs.LocalFileSystem().get_file_info(pafs.FileSelector(f"{local_run}/goodput")), key=lambda i: i.path)
    with open(files[-1].path, "a") as f:
        f.write('{"t": 27.0, "kind": "st')  # a process killed in the middle of a write
    assert account(read_events(pafs.LocalFileSystem(), local_run)).total == pytest.approx(26.0)


def test_stray_files_and_lines_in_the_ledger_are_skipped_naming_them(local_run, tmp_path, caplog, capsys, monkeypatch):
    """A messy run directory: files that are not a process's log, a log that is not text, lines
    that are not events (a time that is a string, a step without its step number, an unknown kind,
    not an object, a time that is infinite or not a number). Each is skipped with a warning naming
    it; the breakdown is the hand-computed one; a restore's live goodput and the CLI's report still
    answer."""
    import os
    import time
    from pathlib import Path

    from ray_resilient.checkpoint.goodput_recorder import GoodputRecorder

    ledger = Path(local_run) / "goodput"
    (ledger / ".DS_Store").write_bytes(b"\x00\x01Bud1\xff")
    (ledger / ".1733000000-rank0-7.jsonl.swp").write_bytes(os.urandom(256))
    (ledger / "notes.txt").write_text('{"t": 1.0, "kind": "job_start", "process": "x"}\n')
    (ledger / "1733000000000000000-rank0-8.jsonl").write_bytes(b"\xff\xfe\x00 not text")
    bad_lines = ['{"t": "soon", "kind": "step", "process": "p", "step": 9, "t_start": 1.0}',
                 '{"t": 30.0, "kind": "step", "process": "p", "t_start": 29.0}',
                 '{"t": 30.0, "kind": "checkpoint_exploded", "process": "p"}', '[1, 2]', '"step"',
                 '{"t": Infinity, "kind": "step", "process": "p", "step": 9, "t_start": 1.0}',
                 '{"t": 30.0, "kind": "save", "process": "p", "step": 9, "t_start": NaN}']
    (ledger / "1733000000000000000-rank0-9.jsonl").write_text("\n".join(bad_lines) + "\n")
    with caplog.at_level("WARNING", logger="ray_resilient.goodput.ledger"):
        events = read_events(pafs.LocalFileSystem(), local_run)
    assert account(events).total == pytest.approx(HAND_COMPUTED["total"])
    warned = caplog.text
    for name in (".DS_Store", ".1733000000-rank0-7.jsonl.swp", "notes.txt", "1733000000000000000-rank0-8.jsonl"):
        assert name in warned, name
    assert warned.count("1733000000000000000-rank0-9.jsonl") == len(bad_lines)

    recorder = GoodputRecorder(RunStorage(pafs.LocalFileSystem(), local_run, str(tmp_path / "local")), 0)
    recorder.restored(time.time(), 5)  # what a restore of this run does
    assert 0 < recorder.metrics()["goodput"] < 1
    recorder.close()
    monkeypatch.chdir(tmp_path)
    out, _ = report_cli(capsys, local_run, "--json")
    assert json.loads(out)["steps_kept"] == 5


def test_remote_ledger_uploads_parts_and_reads_back_the_same(s3_server, tmp_path):
    fs = s3_server.filesystem()
    run_dir = f"{s3_server.bucket}/ledger-test/r"
    write_run(fs, run_dir, str(tmp_path / "spool"))
    breakdown = account(read_events(fs, run_dir))
    for part, seconds in HAND_COMPUTED.items():
        assert getattr(breakdown, part) == pytest.approx(seconds), part


def test_a_days_uploads_are_compacted_so_a_restore_reads_few_objects_and_every_event_once(tmp_path):
    """43,200 uploads (a day at one every 2 s) through a filesystem the ledger treats as remote: the
    process keeps a few dozen objects instead of 43,200, and reading them gives every event once, in
    order, also after a crash between a merge and its deletes left merged pieces behind."""
    fs = pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem())  # remote to the ledger
    writer = LedgerWriter(RunStorage(fs, "run", str(tmp_path / "spool")), rank=0, upload_seconds=3600)
    uploads = 43_200
    for step in range(uploads):
        writer.record("step", t=float(step), step=step, t_start=step - 0.5, data_wait=0.0)
        writer.flush()
    writer.close()
    objects = [i for i in fs.get_file_info(pafs.FileSelector("run/goodput")) if i.type == pafs.FileType.File]
    assert len(objects) <= FAN_IN * 4, len(objects)  # 43,200 < FAN_IN ** 4: at most FAN_IN per size class
    assert [e["step"] for e in read_events(fs, "run")] == list(range(uploads))
    widest = max(objects, key=lambda i: i.size)
    with fs.open_input_stream(widest.path) as stream:
        first_line = stream.read().decode().splitlines(keepends=True)[0]
    start = int(widest.base_name.rsplit(".", 1)[1].split("-")[0])
    leftover = f"{widest.path.rsplit('-', 1)[0].rsplit('.', 1)[0]}.{start:012d}-{start + len(first_line):012d}"
    with fs.open_output_stream(leftover) as out:  # a piece the merge covered, its delete never done
        out.write(first_line.encode())
    assert [e["step"] for e in read_events(fs, "run")] == list(range(uploads))


def test_survivor_mode_charges_the_dropped_step_as_wasted_the_reform_as_restart_and_the_copy_as_restore(tmp_path):
    """Survivor mode, 3 replicas. Lead 0 starts at 1 s, restores nothing, trains steps 1-3; replica 2
    dies in step 4 (dropped at 5.5 s), the group re-forms and trains step 4 at 6-7 s. At 9 s the
    replacement joins: a 0.5 s peer copy, step 5 at 9.5-10.5 s. The lead dies in step 6; replica 1
    takes over: step 6 dropped at 11.5 s, copy-free re-form, step 6 at 12-13 s, finish at 13 s."""
    fs, run_dir = pafs.LocalFileSystem(), str(tmp_path / "runs" / "r")
    storage = RunStorage(fs, run_dir, str(tmp_path / "spool"))
    lead = LedgerWriter(storage, 0, upload_seconds=0.05)
    lead.record("attempt_start", t=1.0, world_size=3)
    lead.record("restore", t=1.0, t_start=1.0, step=0)
    for step in (1, 2, 3):
        lead.record("step", t=1.0 + step, t_start=float(step), step=step, data_wait=0.0)
    lead.record("step_discarded", t=5.5, t_start=4.0, step=4, world_size=3)
    lead.record("membership", t=5.8, step=3, world_size=2, lost=[2], joined=[])
    lead.record("step", t=7.0, t_start=6.0, step=4, data_wait=0.0)
    lead.record("peer_recovery", t=9.5, t_start=9.0, step=4, replicas=[2], bytes=100)
    lead.record("membership", t=9.5, step=4, world_size=3, lost=[], joined=[2])
    lead.record("step", t=10.5, t_start=9.5, step=5, data_wait=0.0)
    lead.close()
    new_lead = LedgerWriter(storage, 0, upload_seconds=0.05)
    new_lead.record("step_discarded", t=11.5, t_start=10.5, step=6, world_size=3)
    new_lead.record("membership", t=11.8, step=5, world_size=2, lost=[0], joined=[])
    new_lead.record("step", t=13.0, t_start=12.0, step=6, data_wait=0.0)
    new_lead.record("finish", t=13.0, step=6)
    new_lead.close()
    breakdown = account(read_events(fs, run_dir))
    assert breakdown.total == pytest.approx(12.0)
    assert breakdown.productive == pytest.approx(6.0)  # steps 1-6, one second each
    assert breakdown.wasted == pytest.approx(1.5 + 1.0)  # the two dropped steps
    assert breakdown.restore == pytest.approx(0.5)  # the replacement's copy
    # Re-forming after each drop, to the next step's start: 5.5 -> 6 and 11.5 -> 12; the gap from
    # the join (7 -> 9) is the lead's own time between steps.
    assert breakdown.init_restart == pytest.approx(0.5 + 0.5)
    assert breakdown.other == pytest.approx(12.0 - 6.0 - 2.5 - 0.5 - 1.0)
    assert (breakdown.attempts, breakdown.failures, breakdown.steps_kept, breakdown.steps_recomputed) == (2, 2, 6, 2)
    png = tmp_path / "timeline.png"
    assert "steps recomputed  2" in render_report(run_dir, str(png)) and png.stat().st_size > 10_000


def test_report_prints_the_breakdown_and_draws_the_timeline(local_run, tmp_path):
    png = tmp_path / "timeline.png"
    text = render_report(local_run, str(png))
    assert "goodput" in text and "16.5%" in text  # 4.3 / 26
    for part in HAND_COMPUTED:
        assert part.replace("_", " ") in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def report_cli(capsys, *args: str) -> tuple[str, str]:
    from ray_resilient.cli import main

    assert main(["goodput", "report", *args]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_cli_report_json_has_the_hand_computed_breakdown(local_run, capsys, monkeypatch, tmp_path):
    import json

    monkeypatch.chdir(tmp_path)
    out, _ = report_cli(capsys, local_run, "--json")
    result = json.loads(out)
    for part, seconds in HAND_COMPUTED.items():
        assert result[part] == pytest.approx(seconds), part
        if part != "total":
            assert result["shares"][part] == pytest.approx(seconds / 26), part
    assert result["goodput"] == pytest.approx(4.3 / 26)
    assert (result["attempts"], result["failures"], result["steps_kept"], result["steps_recomputed"]) == (3, 2, 5, 2)
    assert not list(tmp_path.glob("*.png"))  # --json draws only with --png


def test_cli_report_draws_the_timeline_in_the_current_directory_by_default(local_run, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    out, _ = report_cli(capsys, local_run)
    assert "16.5%" in out and "init restart" in out
    assert "goodput-r.png" in out
    assert (tmp_path / "goodput-r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "runs" / "r" / "goodput" / "timeline.png").exists()  # the ledger holds events only


def test_cli_report_refuses_a_directory_without_a_ledger_naming_it(tmp_path, capsys):
    from ray_resilient.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["goodput", "report", str(tmp_path), "--png", str(tmp_path / "t.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} has no goodput ledger" in err
    assert not (tmp_path / "t.png").exists()


def test_plan_from_run_takes_the_measured_costs_and_options_override_them(local_run, capsys):
    from ray_resilient.cli import main
    from ray_resilient.goodput import daly_interval

    assert main(["goodput", "plan", "--mtbf-hours", "3", "--from-run", local_run, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["save_stall_s"], result["restart_s"], result["step_s"]) == pytest.approx((0.5, sum(STARTS) / 3, 1.0))
    assert result["recommended_interval_steps"] == round(daly_interval(0.5, 3 * 3600) / 1.0)
    assert main(["goodput", "plan", "--mtbf-hours", "3", "--from-run", local_run, "--restart", "1m", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["restart_s"] == 60


@pytest.mark.parametrize("failed", [False, True])
def test_live_goodput_is_logged_every_n_steps_and_once_more_at_a_clean_end(failed):
    """The hook logs the figures as they are at each multiple of its interval, none before the
    restore accounted the ledger (empty figures), and the final ones only when the attempt ends
    cleanly."""
    from ray_resilient.goodput.live_log import LiveGoodputLog

    logged: list[tuple[dict, int]] = []
    figures: dict[str, float] = {}
    hook = LiveGoodputLog(lambda: dict(figures), lambda metrics, step: logged.append((metrics, step)), every=3)
    hook.step_finished(3)  # before the restore accounted the ledger: nothing to log
    for step in range(4, 11):
        figures["goodput"] = step / 100
        hook.step_finished(step)
    hook.attempt_ended(failed=failed)
    expected = [({"goodput": 0.06}, 6), ({"goodput": 0.09}, 9)] + ([] if failed else [({"goodput": 0.1}, 10)])
    assert logged == expected


def test_a_misspelt_goodput_logger_is_refused_by_the_config_before_any_loop_starts():
    from ray_resilient.checkpoint import CheckpointConfig

    with pytest.raises(ValueError, match="goodput_logger is 'mlflow', a callable .* got 'mlfow'"):
        CheckpointConfig(goodput_logger="mlfow")


def test_the_report_names_each_hang_and_a_step_declared_again():
    from ray_resilient.goodput.report import hang_lines

    hangs = [{"kind": "hang", "t": 100.0 + 50 * i, "t_start": 97.5 + 50 * i, "hung_rank": 1, "step": 9,
              "phase": "after step 9", "silent": False} for i in range(2)]
    stopped = {"kind": "hang", "t": 300.0, "t_start": 298.0, "hung_rank": 0, "step": None, "phase": "restore",
               "silent": True}
    lines = hang_lines([{"kind": "step", "t": 1.0}, *hangs, stopped])
    assert lines == [
        "  hang: rank 1 after step 9, no progress in 'after step 9', declared after 2.5 s",
        "  hang: rank 1 after step 9, no progress in 'after step 9', declared after 2.5 s; hang 2 at this step: "
        "the allowance there doubled each time",
        "  hang: rank 0 before its first step, silent: stopped, or its node lost, declared after 2.0 s"]


def run_with_restores(storage: RunStorage) -> None:
    """A run of 8 attempts through the recorder, each restoring as a restore does (its
    ``follow_run`` stores the ended attempts' summaries), on a ledger of a driver, a rank 1 and the
    hang watchdog besides. Each trains 120 steps of about 1 s (a 2nd and a 4th of data wait),
    saving every 50 (durable 0.3 s later, registered), and fails. Attempt 4 falls back to step 150,
    older than attempt 2's steps that its summary counted as kept (it was stored when attempt 3
    restored 200): that summary is folded again."""
    from ray_resilient.checkpoint.goodput_recorder import GoodputRecorder

    def recorder(rank: int = 0):
        return GoodputRecorder(storage, rank)

    driver = LedgerWriter(storage, -1)
    driver.record("job_start", t=0.0)
    driver.close()
    t = 1.0
    for attempt, restored in enumerate((0, 100, 200, 150, 250, 350, 450, 550)):
        rank0 = recorder()
        rank0.event("attempt_start", t=t, world_size=2)
        rank0.event("restore", t=t + 2.0, t_start=t + 1.0, step=restored)
        rank0.follow_run()
        t += 2.0
        for step in range(restored + 1, restored + 121):
            seconds = 1.0 + (step % 7) / 10
            rank0.step(step, t, t + seconds, data_wait=(0.5, 0.25, 0.0, 0.0)[step % 4])
            t += seconds
            if step % 50 == 0:
                rank0.save(step, t, t + 0.2)
                rank0.durable(step, t + 0.5)
                rank0.registered(step)
                t += 0.2
        rank0.close()
        rank1 = LedgerWriter(storage, 1)
        rank1.record("failure", t=t + 0.5, error=f"RuntimeError: attempt {attempt} failed")
        rank1.close()
        if attempt == 5:
            watchdog = LedgerWriter(storage, -2)
            watchdog.record("hang", t=t + 3.0, t_start=t, hung_rank=1, host="h", phase="step", step=restored + 120)
            watchdog.close()
        t += 5.0
    last = recorder()  # the open attempt: restored, no summary of its own
    last.event("attempt_start", t=t, world_size=2)
    last.event("restore", t=t + 1.0, t_start=t, step=650)
    last.follow_run()
    last.close()


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_a_restore_stores_summaries_and_readers_account_them_as_the_raw_events(tmp_path, caplog, remote):
    """Each restore folds the ended attempts into summaries; a reader of the ledger then gives the
    same breakdown, report and planner inputs as every raw event does (a summary that a later restore
    invalidated is folded again), and reads no summarized attempt's events: they are replaced by
    bytes that are not text, and nothing warns of them."""
    from ray_resilient.goodput import read_ledger
    from ray_resilient.goodput.report import format_report

    root = tmp_path / "bucket"
    fs = pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem()) if remote else pafs.LocalFileSystem()
    run_dir = "run" if remote else str(root / "run")
    with caplog.at_level("INFO", logger="ray_resilient.goodput.ledger"):
        run_with_restores(RunStorage(fs, run_dir, str(tmp_path / "spool")))
    assert "Reading the events of 1 summarized attempts again" in caplog.text  # attempt 2's, at attempt 4's restore

    summaries = {i.base_name: i.path for i in fs.get_file_info(pafs.FileSelector(f"{run_dir}/goodput"))
                 if i.base_name.endswith(".summary")}
    assert len(summaries) == 8  # every attempt but the open one
    ledger = read_ledger(fs, run_dir)
    assert not ledger.folded[0].took_over and [a.process for a in ledger.folded] == [ledger.attempts[-1].process]
    assert ledger.attempts[1].lost_after == 150  # attempt 2's summary as attempt 4 folded and stored it again
    raw_events = read_events(fs, run_dir)
    raw = account(raw_events)
    hangs = [e for e in raw_events if e["kind"] == "hang"]
    breakdown = ledger.account()
    assert breakdown.summary() == raw.summary() and 0 < raw.wasted and 0 < raw.hang
    assert list(breakdown.kept_step_seconds.values()) == list(raw.kept_step_seconds.values())
    for measured in ("save_stalls", "durable_latencies", "starts"):
        assert getattr(breakdown, measured) == getattr(raw, measured), measured
    assert format_report(run_dir, breakdown, ledger.hangs) == format_report(run_dir, raw, hangs)

    for info in fs.get_file_info(pafs.FileSelector(f"{run_dir}/goodput")):
        if f"{info.base_name.split('.jsonl')[0]}.summary" in summaries:
            with fs.open_output_stream(info.path) as out:
                out.write(b"\xff\xfe not text")
    caplog.clear()
    with caplog.at_level("INFO", logger="ray_resilient.goodput.ledger"):
        again = read_ledger(fs, run_dir)
    assert not caplog.text
    assert again.account().summary() == raw.summary() and again.failures == ledger.failures


def test_a_long_attempts_timeline_is_kept_in_bins_finer_than_a_pixel_with_each_kinds_seconds(tmp_path):
    """3,000 steps waiting a quarter of each for data (6,000 bars) are summarized as at most
    TIMELINE_BINS bars a kind, each kind's seconds kept, and the report draws them."""
    from ray_resilient.goodput import read_ledger
    from ray_resilient.goodput.accounting import TIMELINE_BINS

    fs, run_dir = pafs.LocalFileSystem(), str(tmp_path / "runs" / "long")
    ledger = LedgerWriter(RunStorage(fs, run_dir, str(tmp_path / "spool")), 0)
    ledger.record("attempt_start", t=0.0, world_size=1)
    ledger.record("restore", t=1.0, t_start=0.5, step=0)
    for step in range(1, 3001):
        ledger.record("step", t=1.0 + step, t_start=float(step), step=step, data_wait=0.25)
    ledger.close()
    attempt, = read_ledger(fs, run_dir).attempts
    assert all(len(spans) <= TIMELINE_BINS for spans in attempt.bars.values())
    seconds = {kind: sum(s for _, s in spans) for kind, spans in attempt.bars.items()}
    assert seconds == pytest.approx({"restore": 0.5, "data_wait": 750.0, "kept": 2250.0})
    png = tmp_path / "timeline.png"
    assert "  steps kept        3000" in render_report(run_dir, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
