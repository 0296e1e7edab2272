"""A rank's progress, reported to the run's hang watchdog from a thread of its own.

The training thread only bumps a counter: :meth:`ProgressReporter.tick` inside a step (the forward
and backward passes of the model's modules, from :mod:`.step_hooks`; each tensor a save stages; each
file a restore verifies or fetches), :meth:`ProgressReporter.step` at a step's end,
:meth:`ProgressReporter.phase` and :meth:`ProgressReporter.saving` between steps (a
``Checkpointer``'s ``progress(phase)`` for work that is neither). Progress made elsewhere counts
too: the reporter's ``sources`` (the samples a data loader's worker processes read, and the failed
reads they retry, while the training thread waits for its batch) are polled at every beat. A daemon
thread sends the count to the watchdog (:mod:`~ray_resilient.watchdog.monitor`) every
:data:`HEARTBEAT_S` (the heartbeat that tells a live rank from a stopped one), with how long this
rank may go without progress before it counts as hung: ``max(floor_s, gap_multiple x`` the p99 of
its recent steps' longest stretch without progress``)`` (the steps after the first
``startup_steps``; the stretches of a phase reported in between, an evaluation or a save, are not a
step's), or ``startup_allowance_s`` while it restores, compiles (its first steps) or stages its
first save; a later save's staging gets ``gap_multiple`` times the previous one's, if that is more.
A wait the library bounds by a setting of its own is allowed that bound
(:meth:`ProgressReporter.allowing`: waiting for a save to become durable, ``save_timeout_s``), and
so is a ``torch.compile`` compilation (``startup_allowance_s``), wherever it happens. A step of any
length that keeps ticking is never a hang, and a rank hung inside a long step is found about as soon
as in a short one. Asked for it, the thread sends the training thread's Python stack.
:meth:`ProgressReporter.close` says goodbye: done, or failing (the watchdog then stops judging the
attempt, which Ray restarts); a forked child (a DataLoader worker) closes its copy of the
connection, so that a rank that dies is seen gone at once. The library's own progress
(:func:`note_progress`) also reaches listeners, where no watchdog looks (survivor mode's restore).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ray_resilient.watchdog.silence import p99

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
STEP_WINDOW = 100  # recent steps whose p99 sets the allowance


@dataclass(frozen=True)
class HangWatchdogConfig:
    """When a rank counts as hung (see the module docstring and :mod:`~ray_resilient.watchdog.monitor`).

    ``silent_floor_s``: a rank that sends no heartbeat for this long (or more, where the heartbeats
    seen arrive late) has stopped. ``floor_s``: the least a rank that answers may go without
    progress; above it, ``gap_multiple`` x the p99 of its recent steps' longest stretch without
    progress. ``startup_allowance_s``: the restore, the first ``startup_steps`` steps, the first
    save's staging and every ``torch.compile`` compilation.
    """

    silent_floor_s: float = 2.0
    floor_s: float = 60.0
    gap_multiple: float = 10.0
    startup_allowance_s: float = 600.0
    startup_steps: int = 3

    def __post_init__(self) -> None:
        if not (self.silent_floor_s > 0 and self.floor_s > 0 and self.gap_multiple > 0
                and self.startup_allowance_s > 0 and self.startup_steps >= 0):
            raise ValueError(f"a hang watchdog needs positive allowances, got {self}")


class ProgressReporter:
    """This rank's link to the watchdog whose ``(host, port, secret)`` ``address()`` returns,
    called on the reporter's thread, so that the training thread never waits for the watchdog to
    start (see the module docstring). ``identity``: the rank, pid, host and node id it reports as;
    ``sources``: counters of progress made outside the training thread; ``clock``: monotonic
    seconds."""

    def __init__(self, config: HangWatchdogConfig, address: Callable[[], tuple[str, int, str]], identity: dict,
                 sources: Sequence[Callable[[], int]] = (), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._progress, self._phase, self._allowance = 0, "start", config.startup_allowance_s
        self._own_phase = True  # the allowance is its phase's (restore, warm-up, save), not its steps'
        self._held: list[tuple[str, float, bool]] = []  # (phase, allowance, own) under each allowing()
        self._last_tick, self._longest_gap = clock(), 0.0
        self._steps = 0
        self._run_step: int | None = None  # the run's step last finished
        self._step_gaps: deque[float] = deque(maxlen=STEP_WINDOW)  # each recent step's longest gap
        self._sources, self._sources_seen = tuple(sources), -1
        self._training_thread = threading.get_ident()
        self._address, self._identity = address, identity
        self._socket: socket.socket | None = None
        self._closed = threading.Event()
        self._goodbye = "done"
        self._connected = threading.Event()
        _REPORTERS.add(self)
        self._thread = threading.Thread(target=self._run, name="ray_resilient_progress", daemon=True)
        self._thread.start()

    @property
    def progress(self) -> int:
        """This rank's progress counter: ticks, steps and phases so far."""
        return self._progress

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

    def phase(self, name: str, allowance_s: float | None = None) -> None:
        """The training thread began ``name``, allowed ``allowance_s`` without progress (None: as a
        step, or ``startup_allowance_s`` while the attempt warms up); the gaps before it are not the
        next step's."""
        self.tick()
        self._longest_gap = 0.0
        self._phase = name
        steady = self._steady_allowance() if allowance_s is None else None
        if steady is None:  # its own allowance: the one given, or the startup allowance while warming up
            self._own_phase = True
            self._allowance = self.config.startup_allowance_s if allowance_s is None else allowance_s
        else:
            self._own_phase, self._allowance = False, steady

    def saving(self, name: str, previous_stall_s: float | None) -> None:
        """The training thread began staging a save (``name``); ``previous_stall_s``: how long the
        previous save of this attempt stalled it, None for its first (buffers are allocated then:
        ``startup_allowance_s``)."""
        if previous_stall_s is None:
            self.phase(name, self.config.startup_allowance_s)
            return
        self.phase(name)
        self._allowance = max(self._allowance, self.config.gap_multiple * previous_stall_s)
        self._own_phase = True

    def hold(self, name: str, allowance_s: float) -> None:
        """Inside whatever the training thread does now, ``name`` began, allowed ``allowance_s``
        without progress (at least what it was allowed already) until :meth:`release`."""
        self._held.append((self._phase, self._allowance, self._own_phase))
        self.tick()
        self._phase, self._allowance, self._own_phase = name, max(allowance_s, self._allowance), True

    def release(self) -> None:
        """The newest :meth:`hold` ended: back to what was allowed before; its stretch is not a step's."""
        if self._held:
            self.tick()
            self._longest_gap = 0.0
            self._phase, self._allowance, self._own_phase = self._held.pop()

    @contextmanager
    def allowing(self, name: str, allowance_s: float) -> Iterator[None]:
        """:meth:`hold` for the ``with`` block."""
        self.hold(name, allowance_s)
        try:
            yield
        finally:
            self.release()

    def step(self, run_step: int | None = None) -> None:
        """A training step (the run's ``run_step``) finished: its longest stretch without progress
        joins the p99 (but for the first ``startup_steps`` of an attempt, slow with compilation and
        warm-up)."""
        self.tick()
        self._steps += 1
        self._run_step = run_step
        if self._steps > self.config.startup_steps:
            self._step_gaps.append(self._longest_gap)
        self.phase(f"step {self._steps} of this attempt" if run_step is None else f"after step {run_step}")

    def _steady_allowance(self) -> float | None:
        if not self._step_gaps:  # still in the first startup_steps: step() keeps none of them
            return None
        return max(self.config.floor_s, self.config.gap_multiple * p99(self._step_gaps))

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
            host, port, secret = self._address()
            if self._closed.is_set():  # closed while the watchdog was starting
                return
            self._socket = connection = socket.create_connection((host, port))
            self._connected.set()
        except Exception:  # noqa: BLE001 - without its watchdog the run trains on, as before it had one
            if not self._closed.is_set():
                logger.warning("Could not reach the hang watchdog; this rank's hangs go undetected", exc_info=True)
            return
        with connection:
            try:
                connection.sendall((json.dumps({**self._identity, "secret": secret}) + "\n").encode())
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
                                                "own": self._own_phase, "s": self._run_step}) + "\n").encode())
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
        try:
            connection.sendall((json.dumps({"bye": self._goodbye}) + "\n").encode())
        except OSError:
            pass

    def _stack(self) -> str:
        frame = sys._current_frames().get(self._training_thread)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(no training thread)"

    def close(self, failed: bool = False) -> None:
        """Say goodbye and stop reporting: ``failed``, the attempt is failing (the watchdog stops
        judging it). The thread ends within a beat, or once the watchdog it still waits for answers
        (not waited for: the watchdog ends with the attempt)."""
        self._goodbye = "failed" if failed else "done"
        self._closed.set()
        if self._connected.is_set():
            self._thread.join(timeout=2 * HEARTBEAT_S)


_REPORTERS: weakref.WeakSet[ProgressReporter] = weakref.WeakSet()
_LISTENERS: list[Callable[[], None]] = []


def note_progress() -> None:
    """Progress of this process's rank, from wherever a long piece of the library's own work gets
    on (a file verified, a chunk fetched, a lease polled), on any thread: a tick of every reporter
    of the process (none: nothing), and a call of every listener (:func:`listening_to_progress`)."""
    for reporter in list(_REPORTERS):
        reporter.tick()
    for listener in list(_LISTENERS):
        listener()


@contextmanager
def listening_to_progress(listener: Callable[[], None]) -> Iterator[None]:
    """Call ``listener`` at every :func:`note_progress` of this process while inside, on the thread
    that made the progress: how work that another process waits on shows it is getting on where no
    watchdog looks (survivor mode's restore from storage)."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)


def _close_in_forked_child() -> None:
    """A forked child (a DataLoader worker) keeps no copy of a reporter's connection: the watchdog
    must see the connection close when the rank dies, not when its workers notice."""
    for reporter in list(_REPORTERS):
        if reporter._socket is not None:
            reporter._socket.close()
        reporter._closed.set()


os.register_at_fork(after_in_child=_close_in_forked_child)
