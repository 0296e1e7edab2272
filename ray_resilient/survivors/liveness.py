"""A replica's sign of life to its membership coordinator: one TCP connection, with heartbeats.

A process that dies closes the connection (the coordinator knows at once). A process that stops
without dying (SIGSTOP, a hang holding the interpreter, a lost node or a partition: no FIN ever
comes) stops sending heartbeats, and the coordinator drops it after :data:`LIVENESS_TIMEOUT_S`.
The heartbeats come from a thread of their own, so a long step, a restore or a state copy on the
training thread does not silence them.
"""

from __future__ import annotations

import asyncio
import socket
import threading

HEARTBEAT_S = 0.25  # how often a replica says it is alive
LIVENESS_TIMEOUT_S = 1.5  # a replica silent this long is dropped as if it died (6 heartbeats missed)


class LivenessLink:
    """This replica's connection to the coordinator's liveness server, with a heartbeat thread."""

    def __init__(self, host: str, port: int, replica: int, token: str):
        self._socket = socket.create_connection((host, port))
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
