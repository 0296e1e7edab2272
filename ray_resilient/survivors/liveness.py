"""A replica's sign of life to its membership coordinator: one TCP connection, with heartbeats.

A process that dies closes the connection (the coordinator knows at once). A process that stops
without dying (SIGSTOP, a hang holding the interpreter, a lost node or a partition: no FIN ever
comes) stops sending heartbeats, and the coordinator drops it after :data:`LIVENESS_TIMEOUT_S`.
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
import weakref

HEARTBEAT_S = 0.25  # how often a replica says it is alive
# A replica silent this long is dropped as if it died (20 heartbeats missed). A live one can be
# silent for a while: the README's job in survivor mode, two runs at once on 2 cores, showed gaps
# of 1.43 s, and a lead dropped after 1.5 s in its checkpoint saves.
LIVENESS_TIMEOUT_S = 5.0


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


async def watch_heartbeats(reader: asyncio.StreamReader) -> str:
    """The coordinator's side of one :class:`LivenessLink`, after its first line: read heartbeats
    until the replica is gone; how it went."""
    try:
        while await asyncio.wait_for(reader.read(4096), LIVENESS_TIMEOUT_S):
            pass  # b"": EOF, the process closed the connection or died
    except asyncio.TimeoutError:
        return f"sent no heartbeat for {LIVENESS_TIMEOUT_S:.1f} s"
    except ConnectionError:
        pass
    return "closed its connection"
