"""A restore's read of a long run's goodput ledger: every event, or the ended attempts' summaries.

Setup
    A generated ledger of ``--events`` events (6 M: a week at 10 steps/s) of rank 0 in
    ``--attempts`` ended attempts and one open one, written straight in the ledger's on-storage
    format: each process's log as objects of up to 4 MiB named by their byte ranges, as a process
    on remote storage leaves them (read here through a filesystem the ledger takes for remote).
    A driver's start; per attempt a rank 1's failure. Each attempt restores the newest checkpoint
    of the one before it (every 100 steps), trains steps of about 0.1 s with a little data wait,
    saving every 100 steps (durable, then registered), until it has its share of the events.
    At each attempt's restore the ledger is read and the ended attempts it had to fold from their
    events are stored as summaries, as ``GoodputRecorder.follow_run`` does (``read_ledger``, then
    ``store_summaries`` of the folded attempts but the open one), so the ledger holds the summary
    of every ended attempt but the last.

Measured, each in a fresh process: its time, and its peak memory: the peak of its resident set
over what it was after the imports (Linux's ``VmHWM``, reset by ``/proc/self/clear_refs``).

    events    a restore before summaries: every event read (``read_events``) and accounted
    restore   the open attempt's restore (``follow_run``): ``read_ledger``, its breakdown, and
              storing the summary of the attempt that ended last (folded from its events)
    reread    a read after it (a survivor lead change, ``status``, ``goodput report``):
              the summaries and the open attempt's events

Output
    One line per measurement, then ``same_breakdown=True`` when all three breakdowns agree
    (``--no-events`` leaves out the events measurement: at 6 M events it takes GiBs).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pyarrow.fs as pafs

OBJECT_BYTES = 4 << 20  # the size of the generated ledger objects
CHECKPOINT_EVERY = 100  # steps
PID = 4242


class ProcessLog:
    """One process's ledger log, written as the objects its uploads would leave."""

    def __init__(self, directory: str, process: str):
        self.prefix = os.path.join(directory, f"{process}.jsonl")
        self.process = process
        self.offset = 0
        self.lines: list[str] = []
        self.pending = 0

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.pending += len(line)
        if self.pending >= OBJECT_BYTES:
            self.flush()

    def flush(self) -> None:
        data = "".join(self.lines).encode()
        if data:
            with open(f"{self.prefix}.{self.offset:012d}-{self.offset + len(data):012d}", "wb") as out:
                out.write(data)
            self.offset += len(data)
        self.lines, self.pending = [], 0


def event(t: float, kind: str, process: str, rank: int, fields: str = "") -> str:
    """A ledger line as ``LedgerWriter.record`` writes it (``fields``: the rest of the JSON object)."""
    return f'{{"t": {t!r}, "kind": "{kind}", "process": "{process}", "rank": {rank}{fields}}}\n'


def start_attempt(directory: str, number: int, t: float, restored: int) -> ProcessLog:
    log = ProcessLog(directory, f"{1_700_000_000_000_000_000 + number}-rank0-{PID}")
    log.add(event(t, "attempt_start", log.process, 0, ', "world_size": 8'))
    log.add(event(t + 2.0, "restore", log.process, 0, f', "t_start": {t + 1.0!r}, "step": {restored}'))
    log.flush()  # uploaded before the restore reads the ledger
    return log


def train(log: ProcessLog, t: float, restored: int, events: int) -> tuple[float, int]:
    """Steps from ``restored`` until the attempt has ``events`` events; (the time, the last step)."""
    step, written = restored, 2
    while written < events:
        step += 1
        seconds = 0.1 + 0.01 * (step * 7919 % 13) / 13
        log.add(event(t + seconds, "step", log.process, 0,
                      f', "step": {step}, "t_start": {t!r}, "data_wait": {0.001 * (step % 3)!r}'))
        t, written = t + seconds, written + 1
        if step % CHECKPOINT_EVERY == 0:
            log.add(event(t + 0.05, "save", log.process, 0, f', "step": {step}, "t_start": {t!r}'))
            log.add(event(t + 0.4, "durable", log.process, 0, f', "step": {step}'))
            log.add(event(t + 0.5, "registered", log.process, 0, f', "step": {step}'))
            t, written = t + 0.05, written + 3
    log.flush()
    return t, step


def fold(filesystem: pafs.FileSystem, run: str, open_process: str) -> None:
    """What a restore does to the ledger: fold the attempts ended since and store their summaries."""
    from ray_resilient.goodput import read_ledger, store_summaries

    ledger = read_ledger(filesystem, run)
    store_summaries(filesystem, run, [a for a in ledger.folded if a.process != open_process])


def generate(root: str, events: int, attempts: int) -> str:
    """Write the ledger (see the module docstring) under ``root``; returns the open attempt's process."""
    directory = os.path.join(root, "run", "goodput")
    os.makedirs(directory)
    filesystem = pafs.SubTreeFileSystem(root, pafs.LocalFileSystem())
    t = 1.7e9
    driver = ProcessLog(directory, f"1699999999000000000-rank-1-{PID}")
    driver.add(event(t, "job_start", driver.process, -1))
    driver.flush()
    restored = 0
    for number in range(attempts + 1):
        log = start_attempt(directory, number, t + 5.0, restored)
        if number == attempts:
            return log.process  # its restore is measured
        if number:
            fold(filesystem, "run", log.process)
        t, last = train(log, t + 7.0, restored, events // attempts)
        failed = ProcessLog(directory, f"{1_700_000_000_000_000_000 + number}-rank1-{PID + 1}")
        failed.add(event(t + 1.0, "failure", failed.process, 1, f', "error": "RuntimeError: attempt {number} lost"'))
        failed.flush()
        restored = last // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        t += 30.0
    raise AssertionError("unreachable")


def measure(what: str, root: str, open_process: str) -> tuple[float, int, dict[str, Any]]:
    """(seconds, peak memory growth in bytes, the breakdown's summary) of ``what``, in this process."""
    from ray_resilient.goodput import account, read_events, read_ledger, store_summaries

    filesystem = pafs.SubTreeFileSystem(root, pafs.LocalFileSystem())
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident set starts again from here
    before = resident_kib("VmRSS")
    started = time.perf_counter()
    if what == "events":
        breakdown = account(read_events(filesystem, "run"))
    else:
        ledger = read_ledger(filesystem, "run")
        breakdown = ledger.account()
        if what == "restore":
            store_summaries(filesystem, "run", [a for a in ledger.folded if a.process != open_process])
    breakdown.goodput  # noqa: B018 - the reference step and the slow steps, computed
    seconds = time.perf_counter() - started
    return seconds, (resident_kib("VmHWM") - before) * 1024, breakdown.summary()


def resident_kib(field: str) -> int:
    """This process's resident set (``VmRSS``) or its peak (``VmHWM``), in KiB (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=6_000_000)
    parser.add_argument("--attempts", type=int, default=100)
    parser.add_argument("--no-events", action="store_true", help="leave out the read of every event")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ledger-scale-") as root:
        started = time.perf_counter()
        open_process = generate(root, args.events, args.attempts)
        size = sum(e.stat().st_size for e in os.scandir(os.path.join(root, "run", "goodput")))
        print(f"generated {args.events} events in {args.attempts} ended attempts and an open one "
              f"({size / 2**20:.0f} MiB, summaries included) in {time.perf_counter() - started:.0f} s")
        results = {}
        for what in ("restore", "reread") if args.no_events else ("events", "restore", "reread"):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                seconds, peak, results[what] = pool.submit(measure, what, root, open_process).result()
            print(f"{what:8} {seconds:7.2f} s  peak {peak / 2**20:7.0f} MiB  goodput {results[what]['goodput']:.4f}  "
                  f"steps kept {results[what]['steps_kept']}  recomputed {results[what]['steps_recomputed']}")
        print(f"same_breakdown={all(summary == results['reread'] for summary in results.values())}")


if __name__ == "__main__":
    main()
