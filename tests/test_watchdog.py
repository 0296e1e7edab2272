"""The hang watchdog: a real watchdog actor, and ranks that are real processes reporting to it.

Each rank process reports steps, then does what its mode says: its training thread gets stuck
(its heartbeats go on), it trains on until it is stopped from outside (SIGSTOP: nothing goes on),
it runs one long step that reports progress inside, or it stages a slow save. Only the first two
are hangs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.fs as pafs
import ray

from ray_resilient.goodput import read_events
from ray_resilient.storage import RunStorage
from ray_resilient.watchdog.monitor import HangWatchdog
from ray_resilient.watchdog.progress import HangWatchdogConfig, ProgressReporter

RANK = textwrap.dedent("""
    import json, sys, time
    from ray_resilient.watchdog.progress import HangWatchdogConfig, ProgressReporter
    host, port, rank, node_id, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    config = HangWatchdogConfig(floor_s=1.5, step_multiple=10, startup_allowance_s=6.0, startup_steps=2)
    identity = {"rank": rank, "pid": __import__("os").getpid(), "host": "localhost", "node_id": node_id}
    progress = ProgressReporter(config, lambda: (host, port), identity)

    def stuck_in_the_training_thread():
        time.sleep(120)  # a collective that never returns

    for step in range(5):
        time.sleep(0.05)
        progress.step(0.05)
    print("trained", flush=True)
    if mode == "stuck":
        stuck_in_the_training_thread()
    elif mode == "stop":  # trains on until the test stops it
        while True:
            time.sleep(0.05)
            progress.step(0.05)
    elif mode == "long_step":  # 4 s, reporting its phases inside (allowed 1.5 s without progress)
        for part in range(8):
            time.sleep(0.5)
            progress.phase(f"evaluation part {part}")
    elif mode == "slow_save":  # staging its first save for 4 s: that is allowed the startup allowance
        progress.saving("save", None)
        time.sleep(4)
    for step in range(5):
        time.sleep(0.05)
        progress.step(0.05)
    progress.close()
    print("done", flush=True)
""")


def start_ranks(watchdog, modes: list[str]) -> dict[str, subprocess.Popen]:
    host, port = ray.get(watchdog.start.remote())
    node_id = ray.get_runtime_context().get_node_id()
    ranks = {mode: subprocess.Popen([sys.executable, "-c", RANK, host, str(port), str(rank), node_id, mode],
                                    stdout=subprocess.PIPE, text=True)
             for rank, mode in enumerate(modes)}
    for process in ranks.values():
        assert process.stdout.readline() == "trained\n"
    return ranks


def test_a_stuck_or_stopped_rank_is_declared_hung_and_killed_a_slow_but_progressing_one_is_not(ray_cluster,
                                                                                               tmp_path):
    """Three attempts' watchdogs. In one, a rank's training thread gets stuck while two others run
    a long step that reports progress and a slow save: nothing is declared while they progress,
    then only the stuck one, with its stack. In another, one rank is stopped and another waits for
    it (stalled too, but still answering, as in a collective): the stopped one is declared, though
    both stalled. In the third, rank 1 was stopped before it reached the watchdog (the watchdog
    knows it only from the identity rank 0 passed): it is declared and killed, not rank 0, which
    waits for it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    storage = RunStorage(pafs.LocalFileSystem(), str(run_dir), str(tmp_path / "local"))
    never_reached = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    os.kill(never_reached.pid, signal.SIGSTOP)
    identity = {"rank": 1, "pid": never_reached.pid, "host": "localhost",
                "node_id": ray.get_runtime_context().get_node_id()}
    watchdogs = [HangWatchdog.remote(storage), HangWatchdog.remote(storage), HangWatchdog.remote(storage, [identity])]
    stuck_modes, stopped_modes = ["long_step", "stuck", "slow_save"], ["stuck", "stop"]
    ranks = [start_ranks(watchdogs[0], stuck_modes), start_ranks(watchdogs[1], stopped_modes),
             start_ranks(watchdogs[2], ["stuck"])]
    try:
        os.kill(ranks[1]["stop"].pid, signal.SIGSTOP)
        for mode in ("long_step", "slow_save"):
            assert ranks[0][mode].stdout.readline() == "done\n" and ranks[0][mode].wait(timeout=60) == 0, mode
        assert ranks[0]["stuck"].wait(timeout=60) == -signal.SIGKILL
        assert ranks[1]["stop"].wait(timeout=60) == -signal.SIGKILL
        assert never_reached.wait(timeout=60) == -signal.SIGKILL
        for waited in (ranks[1]["stuck"], ranks[2]["stuck"]):  # left to its broken collective
            assert waited.poll() is None
        assert ray.get(watchdogs[2].heard.remote()) == [0]
    finally:
        for process in [never_reached, *(p for processes in ranks for p in processes.values())]:
            if process.poll() is None:
                process.kill()
    (stuck,), (stopped,), (never,) = (ray.get(watchdog.declared.remote()) for watchdog in watchdogs)
    assert never["hung_rank"] == 1 and never["pid"] == never_reached.pid
    assert "never reached the watchdog" in never["error"] and "does not answer" in never["error"]
    assert stuck["hung_rank"] == stuck_modes.index("stuck") and stopped["hung_rank"] == stopped_modes.index("stop")
    # Each after 10 x its p99 step (0.5 s), at least the 1.5 s floor; the stuck one's stack says where it is.
    for hang in (stuck, stopped):
        assert 1.5 <= hang["t"] - hang["t_start"] < 10, hang
        assert f"pid {hang['pid']}" in hang["error"]
    assert stuck["phase"] == "step 5 of this attempt"  # (the stopped one may have been stopped before it said so)
    assert "in stuck_in_the_training_thread" in stuck["error"]
    assert "does not answer" in stopped["error"]
    hangs = [e for e in read_events(pafs.LocalFileSystem(), str(run_dir)) if e["kind"] == "hang"]
    assert sorted(e["hung_rank"] for e in hangs) == sorted([stuck["hung_rank"], stopped["hung_rank"], 1])
    for watchdog in watchdogs:
        ray.kill(watchdog)


def test_warm_up_steps_do_not_raise_the_allowance_and_a_later_save_gets_a_multiple_of_the_one_before():
    """The first steps of an attempt (compilation, warm-up) are left out of the p99 that sets the
    allowance. A first save allocates its staging buffers (the startup allowance); a hang in a
    later save's staging is declared as soon as in a step, unless the save before took long."""
    def no_watchdog() -> tuple[str, int]:
        raise ConnectionRefusedError("no watchdog here")

    config = HangWatchdogConfig(floor_s=1.5, step_multiple=10, startup_allowance_s=600.0, startup_steps=2)
    progress = ProgressReporter(config, no_watchdog, {"rank": 0})
    progress.step(4.0)
    progress.step(4.0)
    assert progress.allowance == 600.0  # still warming up
    for _ in range(5):
        progress.step(0.05)
    steady = progress.allowance
    assert steady == 1.5  # the floor: 10 x the p99 step (0.05 s, the warm-up's 4 s left out) is less
    progress.saving("save", None)
    assert progress.allowance == 600.0
    progress.saving("save", 0.01)
    assert progress.allowance == steady
    progress.saving("save", 2.0)
    assert progress.allowance == 20.0
    progress.close()


def test_the_watchdog_a_train_worker_starts_does_not_preload_the_workers_modules(ray_cluster):
    """Created from a worker with spare workers' preload (torch, Ray Train), the watchdog actor
    would inherit it: seconds before it answers, at every restart. It must import only what it uses."""
    from ray_resilient.spare_workers import helper_runtime_env, worker_env

    @ray.remote(num_cpus=0)
    def start_watchdog_from_a_preloading_worker() -> list[bool]:
        import torch  # noqa: F401 - preloaded here, as in a train worker

        watchdog = HangWatchdog.options(runtime_env=helper_runtime_env()).remote(None)
        imported = ray.get(watchdog.__ray_call__.remote(lambda _: [m in sys.modules for m in ("torch", "ray.train")]))
        ray.kill(watchdog)
        return imported

    preloading = {"env_vars": worker_env(("torch", "ray.train.torch"))}
    assert ray.get(start_watchdog_from_a_preloading_worker.options(runtime_env=preloading).remote()) == [False, False]
