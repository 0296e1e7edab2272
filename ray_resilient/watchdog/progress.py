"""A rank's progress, reported to the run's hang watchdog from a thread of its own.

The training thread only bumps a counter: :meth:`ProgressReporter.tick` inside a step (the
forward and backward passes of the model's modules, from :mod:`.step_hooks`; each tensor a save
stages), :meth:`ProgressReporter.step` at a step's end, :meth:`ProgressReporter.phase` and
:meth:`ProgressReporter.saving` between steps (a ``Checkpointer``'s ``progress(phase)`` for work
that is neither). Progress made elsewhere counts too: the reporter's ``sources`` (the samples a
data loader's worker processes read while the training thread waits for its batch) are polled at
every beat. A daemon thread sends the count to the watchdog (:mod:`~ray_resilient.watchdog.monitor`)
every :data:`HEARTBEAT_S`, with how long this rank may go without progress before it counts as
hung: ``max(floor_s, gap_multiple x`` the p99 of its recent steps' longest stretch without
progress``)`` (the steps after the first ``startup_steps``; the stretches of a phase reported in
between, an evaluation or a save, are not a step's), or ``startup_allowance_s`` while it restores,
compiles (its first steps), stages its first save or waits for its final one; a later save's
staging gets ``gap_multiple`` times the previous one's, if that is more. A step of any length that
keeps ticking is never a hang, and a rank hung inside a long step is found about as soon as in a
short one. A process that stops (SIGSTOP, a lost node) stops sending: its last allowance runs out
all the same. Asked for it, the thread sends the training thread's Python stack.
"""
from __future__ import annotations

import json
import logging
import math
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
STEP_WINDOW = 100  # recent steps whose p99 sets the allowance


@dataclass(frozen=True)
class HangWatchdogConfig:
    """When a rank that makes no progress counts as hung (see the module docstring)."""

    floor_s: float = 5.0
    gap_multiple: float = 10.0  # x the p99 of recent steps' longest stretch without progress
    startup_allowance_s: float = 600.0  # restore, the first ``startup_steps`` steps, the first and final saves
    startup_steps: int = 3

    def __post_init__(self) -> None:
        if not (self.floor_s > 0 and self.gap_multiple > 0 and self.startup_allowance_s > 0
                and self.startup_steps >= 0):
            raise ValueError(f"a hang watchdog needs positive allowances, got {self}")


class ProgressReporter:
    """This rank's link to the watchdog whose ``(host, port)`` ``address()`` returns, called on
    the reporter's thread, so that the training thread never waits for the watchdog to start
    (see the module docstring). ``identity``: the rank, pid, host and node id it reports as;
    ``sources``: counters of progress made outside the training thread; ``clock``: monotonic
    seconds."""

    def __init__(self, config: HangWatchdogConfig, address: Callable[[], tuple[str, int]], identity: dict,
                 sources: Sequence[Callable[[], int]] = (), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._progress, self._phase, self._allowance = 0, "start", config.startup_allowance_s
        self._own_phase = True  # the allowance is its phase's (restore, warm-up, save), not its steps'
        self._last_tick, self._longest_gap = clock(), 0.0
        self._steps = 0
        self._step_gaps: deque[float] = deque(maxlen=STEP_WINDOW)  # each recent step's longest gap
        self._sources, self._sources_seen = tuple(sources), -1
        self._training_thread = threading.get_ident()
        self._address, self._identity = address, identity
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray_resilient_progress", daemon=True)
        self._thread.start()

    @property
    def allowance(self) -> float:
        """How long this rank may now go without progress before it counts as hung."""
        return self._allowance

    def tick(self) -> None:
        """Progress inside a step (any thread: autograd's calls backward hooks on its own)."""
        now = self._clock()
        if now - self._last_tick > self._longest_gap:
            self._longest_gap = now - self._last_tick
        self._last_tick = now
        self._progress += 1

    def phase(self, name: str, startup: bool = False) -> None:
        """The training thread began ``name`` (``startup``: a restore or the wait for a final save,
        allowed ``startup_allowance_s``); the gaps before it are not the next step's."""
        self.tick()
        self._longest_gap = 0.0
        self._phase = name
        steady = None if startup else self._steady_allowance()
        self._own_phase = steady is None
        self._allowance = self.config.startup_allowance_s if steady is None else steady

    def saving(self, name: str, previous_stall_s: float | None) -> None:
        """The training thread began staging a save (``name``); ``previous_stall_s``: how long the
        previous save of this attempt stalled it, None for its first (buffers are allocated then:
        ``startup_allowance_s``)."""
        if previous_stall_s is None:
            self.phase(name, startup=True)
            return
        self.phase(name)
        self._allowance = max(self._allowance, self.config.gap_multiple * previous_stall_s)
        self._own_phase = True

    def step(self) -> None:
        """A training step finished: its longest stretch without progress joins the p99 (but for
        the first ``startup_steps`` of an attempt, slow with compilation and warm-up)."""
        self.tick()
        self._steps += 1
        if self._steps > self.config.startup_steps:
            self._step_gaps.append(self._longest_gap)
        self.phase(f"step {self._steps} of this attempt")

    def _steady_allowance(self) -> float | None:
        if not self._step_gaps:  # still in the first startup_steps: step() keeps none of them
            return None
        ordered = sorted(self._step_gaps)
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return max(self.config.floor_s, self.config.gap_multiple * p99)

    def _poll_sources(self) -> None:
        """A tick when the progress made outside the training thread changed since the last beat."""
        if self._sources:
            try:
                seen = sum(source() for source in self._sources)
            except Exception:  # noqa: BLE001 - the beat must go on: a silent rank would count as stopped
                logger.warning("A progress source failed; only the training thread's progress counts now",
                               exc_info=True)
                self._sources = ()
                return
            if seen != self._sources_seen:
                self._sources_seen = seen
                self.tick()

    def _run(self) -> None:
        try:
            address = self._address()
            if self._closed.is_set():  # closed while the watchdog was starting
                return
            connection = socket.create_connection(address)
            self._connected.set()
        except Exception:  # noqa: BLE001 - without its watchdog the run trains on, as before it had one
            if not self._closed.is_set():
                logger.warning("Could not reach the hang watchdog; this rank's hangs go undetected", exc_info=True)
            return
        with connection:
            try:
                connection.sendall((json.dumps(self._identity) + "\n").encode())
                connection.settimeout(HEARTBEAT_S)
            except OSError:
                return
            self._beat(connection)

    def _beat(self, connection: socket.socket) -> None:
        buffered = b""
        while not self._closed.is_set():
            self._poll_sources()
            try:
                connection.sendall((json.dumps({"p": self._progress, "a": self._allowance, "ph": self._phase,
                                                "own": self._own_phase}) + "\n").encode())
                try:
                    buffered += connection.recv(4096)  # waits up to HEARTBEAT_S: the beat's pace
                except socket.timeout:
                    continue
                if not buffered:
                    return  # the watchdog is gone
                if b"stack\n" in buffered:
                    buffered = b""
                    connection.sendall((json.dumps({"stack": self._stack()}) + "\n").encode())
            except OSError:
                return

    def _stack(self) -> str:
        frame = sys._current_frames().get(self._training_thread)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(no training thread)"

    def close(self) -> None:
        """Stop reporting: the thread ends within a beat, or once the watchdog it still waits for
        answers (not waited for: the watchdog ends with the attempt)."""
        self._closed.set()
        if self._connected.is_set():
            self._thread.join(timeout=2 * HEARTBEAT_S)
