"""Free TCP ports on loopback, for servers a test or benchmark starts next to others."""

from __future__ import annotations

import contextlib
import socket

LOOPBACK = "127.0.0.1"


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on loopback right now.

    They are held open together while chosen, so they differ; another process may still take one
    before the caller binds it, which is rare enough for tests.
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    """One port free on loopback right now."""
    return free_ports(1)[0]


def port_open(host: str, port: int, timeout: float = 2) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True
