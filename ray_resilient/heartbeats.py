"""One liveness transport: a process's heartbeats to whoever watches it, over one TCP connection.

The hang watchdog (:mod:`ray_resilient.watchdog`) and survivor mode's membership coordinator
(:mod:`ray_resilient.survivors`) both judge processes by it. The process holds a
:class:`HeartbeatLink`: a thread of its own opens the connection, sends a hello (a JSON object on
its first line: who it is and what proves it), then a JSON line every :data:`HEARTBEAT_S` (what the
watcher wants to hear, or ``{}``), answers the watcher's requests (JSON lines back) and, closed,
says goodbye (``{"bye": "done"}`` or ``"failed"``). A long step, a restore or a state copy on the
training thread does not silence it.

A process that dies closes the connection, so its watcher knows at once. One that stops without
dying (SIGSTOP, a hang that holds the interpreter, a lost node or a partition: no FIN ever comes)
stops sending, and counts as stopped once its silence exceeds the :class:`SilenceRule` of the
heartbeats its watcher hears: a fixed threshold either takes a process starved of CPU on a loaded
machine for a stopped one or waits long for a stopped one (two runs of the README's job at once on
2 cores showed gaps of 1.43 s: a fixed 1.5 s dropped a healthy replica, a fixed 5 s waited long for
a stopped one). A forked child (a DataLoader worker) closes its copy of the connection at once:
else a killed process's connection would stay open until its children noticed their parent gone.
The watcher's side reads a link with :func:`watch_heartbeats`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # how often a process says it is alive
SILENCE_MULTIPLE = 4.0  # x the p99 of the heartbeat gaps heard, where that is more than the floor
GAP_WINDOW = 2000  # recent heartbeat gaps (every process's) whose p99 counts


def p99(values: Sequence[float]) -> float:
    """The 99th percentile of ``values`` (at least one): the smallest value at or above 99% of them."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class SilenceRule:
    """When the processes one watcher hears have stopped: silent beyond ``max(floor_s,
    SILENCE_MULTIPLE x`` the p99 of the gaps between the heartbeats it heard``)``, the floor on a
    quiet machine, more where heartbeats have been late."""

    def __init__(self, floor_s: float = 2.0):
        if not floor_s > 0:
            raise ValueError(f"a silence floor must be > 0 s, got {floor_s!r}")
        self.floor_s = floor_s
        self._gaps: deque[float] = deque(maxlen=GAP_WINDOW)

    def heard(self, gap_s: float) -> None:
        """A heartbeat came ``gap_s`` after the one before it from the same process."""
        self._gaps.append(gap_s)

    @property
    def threshold_s(self) -> float:
        """How long a process may send nothing before it counts as stopped."""
        return max(self.floor_s, SILENCE_MULTIPLE * p99(self._gaps)) if self._gaps else self.floor_s


class HeartbeatLink:
    """This process's heartbeats to a watcher (see the module docstring). ``address``, called on the
    link's thread (the caller never waits for a watcher still starting): the watcher's host, port
    and the hello to send; ``beat``: each heartbeat's message; ``answer``: the reply to a request of
    the watcher (None: no reply); ``unreachable``: what is logged, as a warning, when the watcher
    cannot be reached (the process goes on without it)."""

    def __init__(self, address: Callable[[], tuple[str, int, dict[str, Any]]], *,
                 beat: Callable[[], dict[str, Any]] = dict,
                 answer: Callable[[dict[str, Any]], dict[str, Any] | None] = lambda request: None,
                 unreachable: str = "Could not reach the watcher of this process's heartbeats"):
        self._address, self._beat_message, self._answer, self._unreachable = address, beat, answer, unreachable
        self._socket: socket.socket | None = None
        self._closed = threading.Event()
        self._opened = threading.Event()  # set once the connection is open, or could not be
        self._goodbye = "done"
        _LINKS.add(self)
        self._thread = threading.Thread(target=self._run, name="ray_resilient_heartbeats", daemon=True)
        self._thread.start()

    def wait_open(self, timeout_s: float) -> None:
        """Wait until the connection is open and the hello sent: :class:`ConnectionError` when it
        could not be."""
        if not self._opened.wait(timeout_s) or self._socket is None:
            raise ConnectionError(f"{self._unreachable} within {timeout_s:.0f} s")

    def _run(self) -> None:
        try:
            host, port, hello = self._address()
            if self._closed.is_set():  # closed while the watcher was starting
                return
            connection = socket.create_connection((host, port))
            try:
                connection.sendall(_line(hello))
                connection.settimeout(HEARTBEAT_S)
            except OSError:
                connection.close()
                raise
            self._socket = connection
        except Exception:  # noqa: BLE001 - the process goes on without its watcher
            if not self._closed.is_set():
                logger.warning(self._unreachable, exc_info=True)
            return
        finally:
            self._opened.set()
        with connection:
            self._beat(connection)

    def _beat(self, connection: socket.socket) -> None:
        received = b""
        while not self._closed.is_set():
            try:
                connection.sendall(_line(self._beat_message()))
                try:
                    chunk = connection.recv(4096)  # waits up to HEARTBEAT_S: the beat's pace
                except socket.timeout:
                    continue
                if not chunk:
                    return  # the watcher dropped this process, or is gone
                received += chunk
                while b"\n" in received:
                    request, received = received.split(b"\n", 1)
                    reply = self._answer(json.loads(request))
                    if reply is not None:
                        connection.sendall(_line(reply))
            except (OSError, ValueError):  # the watcher is gone, or sent what no watcher sends
                return
        try:
            connection.sendall(_line({"bye": self._goodbye}))
        except OSError:
            pass

    def close(self, failed: bool = False) -> None:
        """Say goodbye (``failed``: this process is failing) and stop. The thread ends within a
        beat, or once the watcher it still waits for answers (not waited for)."""
        self._goodbye = "failed" if failed else "done"
        self._closed.set()
        if self._socket is not None:
            self._thread.join(timeout=2 * HEARTBEAT_S)


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message) + "\n").encode()


_LINKS: weakref.WeakSet[HeartbeatLink] = weakref.WeakSet()


def _close_in_forked_child() -> None:
    for link in list(_LINKS):
        if link._socket is not None:
            link._socket.close()
        link._closed.set()


os.register_at_fork(after_in_child=_close_in_forked_child)


async def read_hello(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The watcher's side: a link's hello, or None when its first line is not one."""
    try:
        hello = json.loads(await reader.readline())
    except (ConnectionError, ValueError):
        return None
    return hello if isinstance(hello, dict) else None


@dataclass(frozen=True)
class LinkEnded:
    """How a link ended: ``how`` in words, and its goodbye (None: it had none)."""

    how: str
    goodbye: str | None = None


async def watch_heartbeats(reader: asyncio.StreamReader, silence: SilenceRule,
                           on_message: Callable[[dict[str, Any]], None] = lambda message: None, *,
                           drop_when_silent: bool = True) -> LinkEnded:
    """The watcher's side of one link, after its hello: each message to ``on_message``, each gap
    heard by ``silence`` (the rule of every link this watcher hears), until the link says goodbye,
    closes or (``drop_when_silent``) is silent beyond the rule's threshold; how it ended."""
    last = time.monotonic()
    try:
        while True:
            if drop_when_silent:
                try:  # the threshold may have grown since the wait began: wait on until it is out
                    line = await asyncio.wait_for(reader.readline(), last + silence.threshold_s - time.monotonic())
                except asyncio.TimeoutError:
                    if time.monotonic() - last >= silence.threshold_s:
                        return LinkEnded(f"sent no heartbeat for {time.monotonic() - last:.1f} s")
                    continue
            else:
                line = await reader.readline()
            if not line:  # EOF: the process closed the connection or died
                return LinkEnded("closed its connection")
            now = time.monotonic()
            silence.heard(now - last)
            last = now
            message = json.loads(line)
            if "bye" in message:
                return LinkEnded(f"said goodbye ({message['bye']})", message["bye"])
            on_message(message)
    except (ConnectionError, ValueError):
        return LinkEnded("closed its connection")
