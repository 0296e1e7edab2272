"""The hang watchdog: a real watchdog actor, and ranks that are real processes reporting to it.

Each rank process reports steps, then does what its mode says: its training thread gets stuck
(its heartbeats go on), it trains on until it is stopped from outside (SIGSTOP: nothing goes on),
it gets stuck inside a long step after long steps that ticked, it runs a long evaluation that
reports its phases, a long step that ticks, a long wait for data that other processes read, or it
stages a slow save. Only the first three are hangs. Others die (with a forked child that outlives
them, as a DataLoader worker does), fail, pause at a fixed step of the run, or are starved of CPU.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pyarrow.fs as pafs
import pytest
import ray
import torch
import torch.distributed as dist
import torchvision
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ray_resilient.goodput import read_events
from ray_resilient.storage import RunStorage
from ray_resilient.testing import wait_until
from ray_resilient.watchdog.monitor import HangWatchdog
from ray_resilient.watchdog.progress import HangWatchdogConfig, ProgressReporter
from ray_resilient.watchdog.step_hooks import TICKING_MODULES, hold_during_compilations, tick_inside_steps

RANK = textwrap.dedent("""
    import json, os, subprocess, sys, threading, time
    from ray_resilient.watchdog.progress import HangWatchdogConfig, ProgressReporter
    host, port, secret, rank, node_id, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
        sys.argv[5], sys.argv[6]
    config = HangWatchdogConfig(floor_s=2.5, gap_multiple=10, startup_allowance_s=6.0, startup_steps=2)
    identity = {"rank": rank, "pid": os.getpid(), "host": "localhost", "node_id": node_id}
    samples_read = [0]  # what a data loader's worker processes read
    progress = ProgressReporter(config, lambda: (host, port, secret), identity, [lambda: samples_read[0]])

    def stuck_in_the_training_thread():
        threading.Event().wait()  # a collective that never returns (the test kills what is left)

    def ticking_step(seconds):  # its layers' forward and backward passes
        for _ in range(int(seconds / 0.05)):
            time.sleep(0.05)
            progress.tick()
        progress.step()

    for step in range(5):
        time.sleep(0.05)
        progress.step()
    print("trained", flush=True)
    if mode == "stuck":
        stuck_in_the_training_thread()
    elif mode == "stop":  # waited 0.6 s in 3 steps (allowed 6 s), then trains on until the test stops it
        os.setsid()  # its own process group, as a Ray worker leads one, with a DataLoader worker in it
        loader_worker = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
        print(loader_worker.pid, flush=True)
        for step in range(3):
            time.sleep(0.6)  # in a collective, waiting for another rank's evaluation
            progress.step()
        print("waited", flush=True)
        while True:
            time.sleep(0.05)
            progress.step()
    elif mode == "stuck_in_a_long_step":  # steps of 1 s (10 x that: 10 s), 0.05 s without progress at most
        for step in range(3):
            ticking_step(1.0)
        for _ in range(4):
            time.sleep(0.05)
            progress.tick()
        stuck_in_the_training_thread()
    elif mode == "long_step":  # 4 s, reporting its phases inside (allowed 2.5 s without progress)
        for part in range(8):
            time.sleep(0.5)
            progress.phase(f"evaluation part {part}")
    elif mode == "ticking_step":  # 4 s, its layers ticking
        ticking_step(4.0)
    elif mode == "data_wait":  # 4 s blocked in next(loader) while its worker processes read samples
        def workers():
            for _ in range(40):
                time.sleep(0.1)
                samples_read[0] += 1
        reading = threading.Thread(target=workers)
        reading.start()
        reading.join()
        progress.step()
    elif mode == "slow_save":  # staging its first save for 4 s: that is allowed the startup allowance
        progress.saving("save", None)
        time.sleep(4)
    elif mode == "dies":  # forks a child that outlives it (a DataLoader worker), then waits to be killed
        if os.fork() == 0:
            threading.Event().wait()
        print("forked", flush=True)
        stuck_in_the_training_thread()
    elif mode == "fails":  # an exception in its training thread: it says goodbye, failing
        progress.close(failed=True)
        stuck_in_the_training_thread()
    elif mode == "pauses_at_step_9":  # steps 6 to 9 of the run, then 3.5 s in one call without progress
        for step in range(6, 10):
            time.sleep(0.05)
            progress.step(step)
        time.sleep(3.5)
    elif mode == "holds_the_gil":  # a 5 s C call holding Python's GIL: its heartbeat thread cannot send
        import math, re
        re.match(r"(a+)+$", "a" * 16 + "b")  # backtracking: twice as long for every "a" more
        started = time.monotonic()
        re.match(r"(a+)+$", "a" * 21 + "b")
        unit = max(time.monotonic() - started, 1e-4)
        for step in range(4):  # steps of 1 s without progress inside: 10 s allowed without progress
            time.sleep(1.0)
            progress.step()
        started = time.monotonic()
        re.match(r"(a+)+$", "a" * (21 + max(0, round(math.log2(5.0 / unit)))) + "b")
        print(f"held {time.monotonic() - started:.1f}", flush=True)
        progress.step()
    elif mode == "starved":  # steps on until the test has starved it (stopped it now and then) and says so
        while not os.path.exists(sys.argv[7]):
            time.sleep(0.05)
            progress.step()
    for step in range(5):
        time.sleep(0.05)
        progress.step()
    progress.close()
    print("done", flush=True)
""")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_ranks(watchdog, modes: list[str], *extra: str) -> dict[str, subprocess.Popen]:
    host, port, secret = ray.get(watchdog.start.remote())
    node_id = ray.get_runtime_context().get_node_id()
    ranks = {mode: subprocess.Popen([sys.executable, "-c", RANK, host, str(port), secret, str(rank), node_id, mode,
                                     *extra], stdout=subprocess.PIPE, text=True)
             for rank, mode in enumerate(modes)}
    for process in ranks.values():
        assert process.stdout.readline() == "trained\n"
    return ranks


def test_a_stuck_or_stopped_rank_is_declared_hung_and_killed_a_slow_but_progressing_one_is_not(ray_cluster,
                                                                                               tmp_path):
    """Four attempts' watchdogs. In one, a rank's training thread gets stuck while four others run a
    long evaluation that reports its phases, a long step that ticks, a long wait for data read
    by other processes and a slow save: nothing is declared while they progress, then only the
    stuck one, with its stack. In another, one rank is stopped and another waits for it (stalled
    too, but still answering, as in a collective): the stopped one is declared, though both
    stalled, after the smaller of their allowances (the stopped one's is larger: it waited for
    the other's evaluations; silence is judged apart, after 2 s), and killed with its DataLoader
    worker (its process group). In the
    third, rank 1 was stopped before it reached the watchdog (the watchdog knows it only from
    the identity rank 0 passed): it is declared and killed, not rank 0, which waits for it. In
    the fourth, a rank whose steps take 1 s but tick every 0.05 s gets stuck inside a step:
    declared after the floor, not after 10 x its step time."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    storage = RunStorage(pafs.LocalFileSystem(), str(run_dir), str(tmp_path / "local"))
    never_reached = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    os.kill(never_reached.pid, signal.SIGSTOP)
    identity = {"rank": 1, "pid": never_reached.pid, "host": "localhost",
                "node_id": ray.get_runtime_context().get_node_id()}
    watchdogs = [HangWatchdog.remote(storage), HangWatchdog.remote(storage), HangWatchdog.remote(storage, [identity]),
                 HangWatchdog.remote(storage)]
    progressing = ["long_step", "ticking_step", "data_wait", "slow_save"]
    stuck_modes, stopped_modes = ["long_step", "stuck", "ticking_step", "data_wait", "slow_save"], ["stuck", "stop"]
    ranks = [start_ranks(watchdogs[0], stuck_modes), start_ranks(watchdogs[1], stopped_modes),
             start_ranks(watchdogs[2], ["stuck"]), start_ranks(watchdogs[3], ["stuck_in_a_long_step"])]
    try:
        loader_worker = int(ranks[1]["stop"].stdout.readline())
        assert ranks[1]["stop"].stdout.readline() == "waited\n"
        os.kill(ranks[1]["stop"].pid, signal.SIGSTOP)
        for mode in progressing:
            assert ranks[0][mode].stdout.readline() == "done\n" and ranks[0][mode].wait(timeout=60) == 0, mode
        assert ranks[0]["stuck"].wait(timeout=60) == -signal.SIGKILL
        assert ranks[1]["stop"].wait(timeout=60) == -signal.SIGKILL
        # Its DataLoader worker too, which holds copies of its sockets: the others would not see it gone.
        wait_until(lambda: gone(loader_worker), timeout=5, what="the stopped rank's DataLoader worker to be killed")
        assert ranks[3]["stuck_in_a_long_step"].wait(timeout=60) == -signal.SIGKILL
        assert never_reached.wait(timeout=60) == -signal.SIGKILL
        for waited in (ranks[1]["stuck"], ranks[2]["stuck"]):  # left to its broken collective
            assert waited.poll() is None
        assert ray.get(watchdogs[2].heard.remote()) == [0]
    finally:
        for process in [never_reached, *(p for processes in ranks for p in processes.values())]:
            if process.poll() is None:
                process.kill()
    (stuck,), (stopped,), (never,), (in_long_step,) = (ray.get(watchdog.declared.remote()) for watchdog in watchdogs)
    assert never["hung_rank"] == 1 and never["pid"] == never_reached.pid
    assert "never reached the watchdog" in never["error"] and "does not answer" in never["error"]
    assert stuck["hung_rank"] == stuck_modes.index("stuck") and stopped["hung_rank"] == stopped_modes.index("stop")
    # Each after the 2.5 s floor (10 x the p99 stretch without progress, 0.05 s, is less; the stuck
    # one once the others stopped progressing): the one in long steps too (10 x its 1 s steps would
    # be 10 s); the stopped one after 2 s of silence (its own allowance is 6 s, the other's 2.5 s);
    # the stuck one's stack says where it is.
    for hang in (stuck, in_long_step):
        assert 2.5 <= hang["t"] - hang["t_start"] < (10 if hang is stuck else 5), hang
    assert 2.0 <= stopped["t"] - stopped["t_start"] < 5 and stopped["silent"], stopped
    for hang in (stuck, stopped, in_long_step):
        assert f"pid {hang['pid']}" in hang["error"]
    assert in_long_step["phase"] == "step 8 of this attempt"
    assert stuck["phase"] == "step 5 of this attempt"  # (the stopped one may have been stopped before it said so)
    assert "in stuck_in_the_training_thread" in stuck["error"]
    assert "does not answer" in stopped["error"]
    hangs = [e for e in read_events(pafs.LocalFileSystem(), str(run_dir)) if e["kind"] == "hang"]
    assert sorted(e["hung_rank"] for e in hangs) == sorted([stuck["hung_rank"], stopped["hung_rank"], 1, 0])
    for watchdog in watchdogs:
        ray.kill(watchdog)


def run_storage(tmp_path) -> RunStorage:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return RunStorage(pafs.LocalFileSystem(), str(run_dir), str(tmp_path / "local"))


def stops_judging(watchdog) -> bool:
    return ray.get(watchdog.__ray_call__.remote(lambda self: self._checker is not None and self._checker.done()))


def test_a_rank_that_dies_or_fails_is_no_hang_and_the_ranks_waiting_for_it_are_not_declared(ray_cluster, tmp_path):
    """In one attempt a rank is SIGKILLed while a forked child of it (a DataLoader worker) lives on;
    in another a rank says goodbye failing (an exception). The other rank waits for it, answering
    without progress, as in a collective. The watchdog sees the death at once (the child closed its
    copy of the connection), stops judging the failing attempt, and declares nobody: Ray restarts
    the worker group for the death, not for a hang."""
    storage = run_storage(tmp_path)
    watchdogs = [HangWatchdog.remote(storage), HangWatchdog.remote(storage)]
    ranks = [start_ranks(watchdogs[0], ["stuck", "dies"]), start_ranks(watchdogs[1], ["stuck", "fails"])]
    child = None
    try:
        assert ranks[0]["dies"].stdout.readline() == "forked\n"
        child, = psutil.Process(ranks[0]["dies"].pid).children()
        os.kill(ranks[0]["dies"].pid, signal.SIGKILL)
        for watchdog in watchdogs:
            wait_until(lambda: stops_judging(watchdog), timeout=30, what="the watchdog to stop judging")
        assert child.is_running()  # it still holds its copy of the dead rank's connection, closed
        died, failed = (ray.get(watchdog.failing.remote()) for watchdog in watchdogs)
        assert died.startswith("rank 1 ") and "without a goodbye" in died
        assert failed.startswith("rank 1 ") and failed.endswith("failed")
        assert [ray.get(watchdog.declared.remote()) for watchdog in watchdogs] == [[], []]
        assert ranks[0]["stuck"].poll() is None and ranks[1]["stuck"].poll() is None
    finally:
        if child is not None:
            child.kill()
        for process in (p for processes in ranks for p in processes.values()):
            process.kill()
        for watchdog in watchdogs:
            ray.kill(watchdog)
    assert not [e for e in read_events(pafs.LocalFileSystem(), storage.experiment_path) if e["kind"] == "hang"]


def test_only_the_attempts_ranks_can_talk_to_the_watchdog(ray_cluster, tmp_path):
    """A connection without the attempt's secret, or with it but as a process that is not the rank
    it names, is refused: a network peer cannot have a pid of its choice killed (by going silent)
    or mask a hang (by sending progress)."""
    me = {"rank": 0, "pid": os.getpid(), "host": "localhost", "node_id": ray.get_runtime_context().get_node_id()}
    watchdog = HangWatchdog.remote(run_storage(tmp_path), [me])
    host, port, secret = ray.get(watchdog.start.remote())
    try:
        for stranger in ({**me, "secret": "guessed"}, {**me, "pid": 1, "secret": secret}, {"rank": 0, "secret": secret},
                         "not json"):
            with socket.create_connection((host, port)) as connection:
                connection.sendall((json.dumps(stranger) + "\n").encode())
                connection.settimeout(30)
                assert connection.recv(100) == b""  # refused: closed
        assert ray.get(watchdog.heard.remote()) == []
        with socket.create_connection((host, port)) as connection:  # the rank itself
            connection.sendall((json.dumps({**me, "secret": secret}) + "\n").encode())
            wait_until(lambda: ray.get(watchdog.heard.remote()) == [0], timeout=30, what="rank 0 admitted")
    finally:
        ray.kill(watchdog)


def test_a_hung_rank_is_killed_even_when_the_ledger_cannot_be_written(ray_cluster, tmp_path):
    """The run directory is a file, so the ``hang`` event cannot be recorded: the stuck rank is
    killed all the same, and the declaration is kept in memory."""
    not_a_directory = tmp_path / "run"
    not_a_directory.write_text("a file where the run directory should be")
    watchdog = HangWatchdog.remote(RunStorage(pafs.LocalFileSystem(), str(not_a_directory), str(tmp_path / "l")))
    ranks = start_ranks(watchdog, ["stuck"])
    try:
        assert ranks["stuck"].wait(timeout=60) == -signal.SIGKILL
        declared, = ray.get(watchdog.declared.remote())
        assert declared["hung_rank"] == 0 and not declared["silent"]
    finally:
        ranks["stuck"].kill()
        ray.kill(watchdog)


def test_a_pause_at_a_fixed_step_costs_one_restart_not_a_crash_loop(ray_cluster, tmp_path):
    """A rank pauses 3.5 s without progress after step 9 of the run (allowed 2.5 s) in every
    attempt. The first attempt's watchdog declares it at step 9 and keeps that in the run's hang
    history; the next attempt's doubles the allowance there (5 s), and the pause passes."""
    storage = run_storage(tmp_path)
    first = HangWatchdog.remote(storage)
    rank = start_ranks(first, ["pauses_at_step_9"])["pauses_at_step_9"]
    assert rank.wait(timeout=60) == -signal.SIGKILL
    declared, = ray.get(first.declared.remote())
    assert declared["step"] == 9 and declared["phase"] == "after step 9"
    wait_until(lambda: (tmp_path / "run" / "watchdog" / "hangs.json").exists(), timeout=30,
               what="the hang history to be written")
    second = HangWatchdog.remote(storage)
    rank = start_ranks(second, ["pauses_at_step_9"])["pauses_at_step_9"]
    try:
        assert rank.stdout.readline() == "done\n" and rank.wait(timeout=60) == 0
        assert ray.get(second.declared.remote()) == []
    finally:
        rank.kill()
        for watchdog in (first, second):
            ray.kill(watchdog)
    hang, = [e for e in read_events(pafs.LocalFileSystem(), storage.experiment_path) if e["kind"] == "hang"]
    assert hang["step"] == 9


def test_a_rank_whose_long_c_call_holds_the_gil_is_alive_not_stopped(ray_cluster, tmp_path):
    """Its heartbeats stop for about 5 s (over twice the silence allowed on a quiet machine) while its
    process runs: the watchdog sees it runnable on its node and judges its progress instead (its
    1 s steps allow 10 s): nothing is declared, and it trains on to the end."""
    watchdog = HangWatchdog.remote(run_storage(tmp_path))
    rank = start_ranks(watchdog, ["holds_the_gil"])["holds_the_gil"]
    try:
        held = rank.stdout.readline()
        assert held.startswith("held "), ray.get(watchdog.declared.remote())
        assert float(held.split()[1]) >= 3.0, held  # silent for 1.5 x the floor
        assert rank.stdout.readline() == "done\n" and rank.wait(timeout=60) == 0
        assert ray.get(watchdog.declared.remote()) == []
    finally:
        rank.kill()
        ray.kill(watchdog)


def test_silence_is_judged_against_the_heartbeat_gaps_of_the_run(ray_cluster, tmp_path):
    """On a quiet machine a stopped rank is declared about 2 s after its last heartbeat. A rank
    starved of CPU (stopped for 1.2 s now and then by the test, as a loaded machine would) raises
    the threshold to 4 x its gaps' p99: a 3 s gap later is no stop, and nothing is declared."""
    storage = run_storage(tmp_path)
    quiet, loaded = HangWatchdog.remote(storage), HangWatchdog.remote(storage)
    starved_enough = tmp_path / "starved"
    stopped = start_ranks(quiet, ["starved"], str(tmp_path / "never"))["starved"]
    starved = start_ranks(loaded, ["starved"], str(starved_enough))["starved"]
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert stopped.wait(timeout=60) == -signal.SIGKILL
        assert time.monotonic() - stopped_at < 4.0
        for pause in (1.2, 1.2, 1.2, 1.2, 3.0):  # the starvation the test inflicts, not a wait
            os.kill(starved.pid, signal.SIGSTOP)
            time.sleep(pause)
            os.kill(starved.pid, signal.SIGCONT)
            time.sleep(0.5)
        assert ray.get(loaded.silence_threshold.remote()) >= 4.5
        starved_enough.touch()
        assert starved.stdout.readline() == "done\n" and starved.wait(timeout=60) == 0
        assert ray.get(loaded.declared.remote()) == []
        declared, = ray.get(quiet.declared.remote())
        assert declared["silent"] and declared["pid"] == stopped.pid
    finally:
        for process in (stopped, starved):
            process.kill()
        for watchdog in (quiet, loaded):
            ray.kill(watchdog)


def test_the_allowance_is_a_multiple_of_the_longest_stretch_without_progress_of_steady_steps():
    """The allowance follows the p99 of recent steps' longest stretch without progress, not their
    length: long steps that tick keep it at the floor. The first steps of an attempt (compilation,
    warm-up) are left out, and so are the stretches of a phase between steps (a save's staging).
    A first save allocates its staging buffers (the startup allowance); a hang in a later save's
    staging is declared as soon as in a step, unless the save before took long."""
    def no_watchdog() -> tuple[str, int, str]:
        raise ConnectionRefusedError("no watchdog here")

    now = [0.0]

    def step(seconds: float, ticks: int = 0) -> None:
        for _ in range(ticks):
            now[0] += seconds / (ticks + 1)
            progress.tick()
        now[0] += seconds / (ticks + 1)
        progress.step()

    config = HangWatchdogConfig(floor_s=1.5, gap_multiple=10, startup_allowance_s=600.0, startup_steps=2)
    progress = ProgressReporter(config, no_watchdog, {"rank": 0}, clock=lambda: now[0])
    step(4.0)
    step(4.0)
    assert progress.allowance == 600.0  # still warming up
    for _ in range(5):
        step(0.05)
    steady = progress.allowance
    assert steady == 1.5  # the floor: 10 x the p99 stretch (0.05 s, the warm-up's 4 s left out) is less
    for _ in range(5):
        step(3.0, ticks=59)  # 3 s steps, 0.05 s without progress at most
    assert progress.allowance == steady
    step(0.3)
    assert progress.allowance == pytest.approx(3.0)  # a step of 0.3 s without progress: 10 x that
    progress.saving("save", None)
    assert progress.allowance == 600.0
    progress.saving("save", 0.01)
    assert progress.allowance == pytest.approx(3.0)
    progress.saving("save", 2.0)
    assert progress.allowance == 20.0
    now[0] += 2.0  # the save's staging: not a step's stretch
    progress.phase("training")
    step(0.05)
    assert progress.allowance == pytest.approx(3.0)
    with progress.allowing("waiting for saves to be durable", 660.0):  # a wait save_timeout_s bounds
        assert progress.allowance == 660.0
        now[0] += 100.0  # not a step's stretch either
    assert progress.allowance == pytest.approx(3.0)
    step(0.05)
    assert progress.allowance == pytest.approx(3.0)
    allowed_while_compiling = []

    def backend(graph, inputs):  # runs inside dynamo's compilation
        allowed_while_compiling.append(progress.allowance)
        return graph.forward

    stop = hold_during_compilations(progress)
    torch.compile(torch.nn.Linear(2, 2), backend=backend)(torch.zeros(1, 2))
    stop()
    assert allowed_while_compiling == [600.0] and progress.allowance == pytest.approx(3.0)
    progress.close()


def test_the_librarys_own_long_waits_are_progress(tmp_path):
    """Watching another driver's lease until it expires, verifying a restore's files and reading
    them tick the process's reporter as they get on (a watch over 600 s, or a long restore, is no
    hang)."""
    import hashlib

    from ray_resilient.checkpoint.integrity import verify_file
    from ray_resilient.checkpoint.lease import RunLease

    def no_watchdog() -> tuple[str, int, str]:
        raise ConnectionRefusedError("no watchdog here")

    progress = ProgressReporter(HangWatchdogConfig(), no_watchdog, {"rank": 0})
    filesystem, run_dir = pafs.LocalFileSystem(), str(tmp_path / "run")
    filesystem.create_dir(run_dir)
    dead = RunLease(filesystem, run_dir, "run-a", ttl_s=1.0, renew_every_s=0.2, settle_s=0.0)
    dead.acquire()
    dead.stop()  # its driver died: the next driver watches the lease for its TTL
    before = progress.progress
    taker = RunLease(filesystem, run_dir, "run-b", ttl_s=1.0, renew_every_s=0.2, settle_s=0.0)
    taker.acquire()
    taker.release()
    assert progress.progress - before >= 4  # a tick a poll, every 0.05 s for 1 s
    shard = os.urandom(20 << 20)  # 20 MiB: three chunks of 8 MiB
    (tmp_path / "run" / "shard.distcp").write_bytes(shard)
    before = progress.progress
    verify_file(filesystem, run_dir, "shard.distcp", {"sha256": hashlib.sha256(shard).hexdigest(), "bytes": len(shard)},
                len(shard))
    assert progress.progress - before >= 3
    # Reading a checkpoint (DCP, through the restore's planner): each tensor read ticks.
    import torch.distributed.checkpoint as dcp

    from ray_resilient.checkpoint.safe_loading import WeightsOnlyLoadPlanner

    state = {f"layer{i}": torch.randn(4) for i in range(5)}
    dcp.save(state, checkpoint_id=str(tmp_path / "checkpoint"))
    before = progress.progress
    dcp.load({k: torch.zeros(4) for k in state}, checkpoint_id=str(tmp_path / "checkpoint"),
             planner=WeightsOnlyLoadPlanner())
    assert progress.progress - before >= 5
    progress.close()


def test_the_librarys_own_progress_reaches_a_listener_while_it_listens():
    """How a survivor-mode replica restoring from storage tells the others waiting that it gets on
    (no watchdog there): every :func:`note_progress` inside, none after."""
    from ray_resilient.watchdog.progress import listening_to_progress, note_progress

    heard: list[int] = []
    with listening_to_progress(lambda: heard.append(1)):
        note_progress()
        note_progress()
    note_progress()
    assert heard == [1, 1]


def test_a_failing_progress_source_leaves_the_heartbeat_going():
    """A source of progress that raises is dropped with a warning: the reporter thread goes on
    beating (had it died, its connection would close and the watchdog stop watching the rank)."""
    def broken_source() -> int:
        raise OSError("the loader is gone")

    server = socket.create_server(("127.0.0.1", 0))
    progress = ProgressReporter(HangWatchdogConfig(), lambda: (*server.getsockname(), "secret"), {"rank": 0},
                                [broken_source])
    connection, _ = server.accept()
    with connection, connection.makefile() as beats:
        assert json.loads(beats.readline()) == {"rank": 0, "secret": "secret"}
        progress.tick()
        assert json.loads([beats.readline() for _ in range(4)][-1])["p"] >= 1  # beats go on, with the tick
    progress.close()
    server.close()


@pytest.mark.parametrize("wrap", ["plain", "ddp", "fsdp2"])
def test_a_models_forward_and_backward_passes_tick_and_its_gradients_stay_the_same(wrap, tmp_path):
    """A ResNet-18's 16 hooked modules tick in its forward pass and as often in its backward pass
    (their output gradients, under DDP and FSDP2 too; its in-place ReLUs break module backward hooks);
    the gradients are bitwise those of the model without hooks; removed, the hooks tick no more."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torchvision.models.resnet18(num_classes=4)
        model = copy.deepcopy(plain)
        if wrap == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif wrap == "fsdp2":
            for block in (model.layer1, model.layer2, model.layer3, model.layer4):
                fully_shard(block)
            fully_shard(model)
        ticks = [0]
        handles = tick_inside_steps(model, lambda: ticks.__setitem__(0, ticks[0] + 1))
        images = torch.randn(2, 3, 32, 32)
        loss = model(images).sum()
        forward = ticks[0]
        assert forward >= TICKING_MODULES  # (a ReLU module that a block calls twice ticks twice)
        loss.backward()
        assert ticks[0] == 2 * forward
        plain(images).sum().backward()
        for (name, expected), hooked in zip(plain.named_parameters(), model.parameters(), strict=True):
            grad = hooked.grad.full_tensor() if isinstance(hooked.grad, DTensor) else hooked.grad
            assert torch.equal(grad, expected.grad), name
        for handle in handles:
            handle.remove()
        model(images).sum().backward()
        assert ticks[0] == 2 * forward
    finally:
        dist.destroy_process_group()


def test_the_watchdog_a_train_worker_starts_does_not_preload_the_workers_modules(ray_cluster):
    """Created from a worker with spare workers' preload (torch, Ray Train), the watchdog actor
    would inherit it: seconds before it answers, at every restart. It must import only what it uses."""
    from ray_resilient.spare_workers import helper_runtime_env, worker_env

    @ray.remote(num_cpus=0)
    def start_watchdog_from_a_preloading_worker() -> list[bool]:
        importlib.import_module("torch")  # preloaded here, as in a train worker

        watchdog = HangWatchdog.options(runtime_env=helper_runtime_env()).remote(None)
        imported = ray.get(watchdog.__ray_call__.remote(lambda _: [m in sys.modules for m in ("torch", "ray.train")]))
        ray.kill(watchdog)
        return imported

    preloading = {"env_vars": worker_env(("torch", "ray.train.torch"))}
    assert ray.get(start_watchdog_from_a_preloading_worker.options(runtime_env=preloading).remote()) == [False, False]
