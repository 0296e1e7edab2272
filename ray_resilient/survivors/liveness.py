"""A replica's sign of life to its membership coordinator: one TCP connection, with heartbeats.

A process that dies closes the connection (the coordinator knows at once). A process that stops
without dying (SIGSTOP, a hang holding the interpreter, a lost node or a partition: no FIN ever
comes) stops sending heartbeats, and the coordinator drops it once its silence exceeds the
:class:`~ray_resilient.watchdog.silence.SilenceRule` of the heartbeats it hears: 2 s on a quiet
machine, more where a loaded one starves live replicas (two runs of the README's job at once on 2
cores showed gaps of 1.43 s: a fixed 1.5 s dropped a healthy lead, a fixed 5 s waited long for a
stopped one).
The heartbeats come from a thread of their own, so a long step, a restore or a state copy on the
training thread does not silence them. A forked child (a DataLoader worker) closes its copy of the
connection at once: else a killed replica's connection would stay open until its children noticed
their parent gone, and it would be dropped only once silent.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import weakref

from ray_resilient.watchdog.silence import SilenceRule

HEARTBEAT_S = 0.25  # how often a replica says it is alive


class LivenessLink:
    """This replica's connection to the coordinator's liveness server, with a heartbeat thread."""

    def __init__(self, host: str, port: int, replica: int, token: str):
        self._socket = socket.create_connection((host, port))
        _LINKS.add(self)
        self._socket.sendall(f"{replica} {token}\n".encode())
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="survivor-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            try:
                self._socket.sendall(b".")
            except OSError:  # the coordinator dropped this replica (or is gone): it learns at its next re-form
                return

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self._socket.close()


_LINKS: weakref.WeakSet[LivenessLink] = weakref.WeakSet()


def _close_in_forked_child() -> None:
    for link in list(_LINKS):
        link._socket.close()


os.register_at_fork(after_in_child=_close_in_forked_child)


async def watch_heartbeats(reader: asyncio.StreamReader, silence: SilenceRule) -> str:
    """The coordinator's side of one :class:`LivenessLink`, after its first line: read heartbeats
    (each gap heard by ``silence``, the rule of every link the coordinator watches) until the
    replica is gone; how it went."""
    last = time.monotonic()
    try:
        while True:
            try:  # the threshold may have grown since the wait began: wait on until it is out
                beat = await asyncio.wait_for(reader.read(4096), last + silence.threshold_s - time.monotonic())
            except asyncio.TimeoutError:
                if time.monotonic() - last >= silence.threshold_s:
                    return f"sent no heartbeat for {time.monotonic() - last:.1f} s"
                continue
            if not beat:  # EOF: the process closed the connection or died
                return "closed its connection"
            now = time.monotonic()
            silence.heard(now - last)
            last = now
    except ConnectionError:
        return "closed its connection"
